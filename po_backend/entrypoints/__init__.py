"""Commands: `prefillonly` (`cli`), the server (`launch_server`) and N workers behind the SGLang
router (`launch_cluster`). The only modules that import `po_backend.server`."""
