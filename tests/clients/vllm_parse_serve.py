"""Parse ``vllm serve`` lines with vLLM's own argument parser and report what each became.

Usage (in the venv made by scripts/setup-vllm; not importable from the main venv):

    .venv-vllm/bin/python tests/clients/vllm_parse_serve.py LINES.json OUT.json

LINES.json: a list of lines as kvcal prints them ("vllm serve MODEL --kv-cache-dtype ..."). Each is split as a shell
would, its model (the positional after ``serve``) passed as ``--model``, and the rest parsed by a
``FlexibleArgumentParser`` that ``EngineArgs.add_cli_args`` filled, as ``vllm serve`` parses engine options.
OUT.json: [{"line": str, "error": null or the parser's message, "kv_cache_dtype": str, "attention_backend": str or
null, "kv_cache_dtype_skip_layers": [...]}], one per line.
"""

import contextlib
import io
import json
import os
import shlex
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def parse(line: str) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(line)
    if words[:2] != ["vllm", "serve"] or len(words) < 3:
        return {"line": line, "error": "not a 'vllm serve MODEL ...' line"}
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(["--model", words[2], *words[3:]])
    except SystemExit:
        return {"line": line, "error": stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else "exit"}
    backend = args.attention_backend
    return {"line": line, "error": None, "kv_cache_dtype": args.kv_cache_dtype,
            "attention_backend": None if backend is None else str(getattr(backend, "name", backend)),
            "kv_cache_dtype_skip_layers": list(args.kv_cache_dtype_skip_layers or [])}


def main(src: str, dst: str) -> None:
    with open(src) as f:
        lines = json.load(f)
    with open(dst, "w") as f:
        json.dump([parse(line) for line in lines], f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
