"""Developer scripts run from the checkout (`python -m scripts.NAME`); a regular package, so a
`scripts` package some other distribution installs cannot shadow it."""
