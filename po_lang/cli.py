"""`prefillonly`: the command-line entry point (vLLM's `vllm serve MODEL` shape).

prefillonly serve MODEL [server flags]     # = python -m po_backend.entrypoints.launch_server --model-path MODEL ...
prefillonly label INPUT --labels A,B ...   # label a JSONL / CSV / Parquet file (prefillonly label --help)
prefillonly run-batch -i IN -o OUT [...]   # an OpenAI / vLLM batch file (prefillonly run-batch --help)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = (
    "usage: prefillonly {serve MODEL | label INPUT | run-batch -i IN -o OUT} [flags]   "
    "(prefillonly serve|label|run-batch --help lists the flags)"
)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest = args[0], args[1:]
    if command == "serve":
        # Lazy: the server stack (torch, FastAPI) loads only for `serve`.
        from po_backend.entrypoints.launch_server import main as serve

        if rest and not rest[0].startswith("-"):  # the model as a positional argument
            rest = ["--model-path", rest[0], *rest[1:]]
        serve(rest)
    elif command == "label":
        from po_lang.label import main as label

        sys.exit(label(rest))
    elif command == "run-batch":
        from po_lang.run_batch import main as run_batch

        sys.exit(run_batch(rest))
    else:
        raise SystemExit(f"prefillonly: unknown command {command!r}\n{USAGE}")


if __name__ == "__main__":
    main()
