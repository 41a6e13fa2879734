"""`python -m po_backend.launch_server`, as `python -m sglang.launch_server`: see po_backend.entrypoints.launch_server."""

from po_backend.entrypoints.launch_server import main

if __name__ == "__main__":
    main()
