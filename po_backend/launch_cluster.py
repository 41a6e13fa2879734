"""`python -m po_backend.launch_cluster`, as `python -m sglang.launch_cluster`: see po_backend.entrypoints.launch_cluster."""

from po_backend.entrypoints.launch_cluster import main

if __name__ == "__main__":
    main()
