"""The `strata` command line: pull a model, generate a completion (and, later, serve)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from api.config import KV_TYPE_CHOICES, ServerConfig
from api.config_load import add_serve_arguments, config_from_args
from cuda_kernels.build import DEFAULT_ARCHS, SUPPORTED_ARCHS
from engine.loader import CPU_WEIGHTS
from engine.model_store import ModelFetchError, default_model_name, resolve_model
from engine.units import MIB

_USER_ERRORS = (ValueError, FileNotFoundError, ModelFetchError, MemoryError)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except _USER_ERRORS as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="LLM inference server for local GGUF models")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    pull = sub.add_parser("pull", help="fetch a model into $STRATA_HOME, compile its CPU kernels, print its path")
    pull.add_argument("name", nargs="?", default=default_model_name(),
                      help=f"a known model (--list shows them; default {default_model_name()}), ollama:NAME[:TAG], "
                      "lmstudio:PUBLISHER/REPO[/FILE], hf:OWNER/REPO[:QUANT] or a .gguf path")
    _add_hf_flag(pull)
    pull.add_argument("--list", action="store_true",
                      help="list the known models and the models on disk (Ollama, LM Studio, Hugging Face cache)")
    pull.add_argument("--no-warm", action="store_true",
                      help="only fetch the file: skip loading the model and compiling its numpy-backend kernels "
                      "into numba's disk cache (the first `strata serve` of it then compiles them)")
    pull.set_defaults(func=_cmd_pull)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    _add_hf_flag(serve)
    serve.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="print the completion of one prompt")
    gen.add_argument("--model", default=default_model_name(),
                     help="model name, ollama:, lmstudio: or hf: source (as for strata serve), or path to a .gguf")
    _add_hf_flag(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="render the prompt as one user message")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--chat-template", default=None, help="jinja file overriding the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    # Sampling left unset takes what a request that sets none gets from strata serve (api/sampling_defaults.py:
    # the GGUF's keys, the model store entry, llama-server's defaults).
    for flag, kind in (("--temperature", float), ("--top-k", int), ("--top-p", float), ("--min-p", float),
                       ("--presence-penalty", float), ("--frequency-penalty", float), ("--seed", int)):
        gen.add_argument(flag, type=kind, default=None, help="default: the model's, as for strata serve")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ctx-size", type=int, default=4096, help="tokens of KV memory to reserve")
    # The server's defaults and choices, from their one home (ServerConfig's fields)
    server = ServerConfig.model_fields
    gen.add_argument("--prefill-chunk", type=int, default=server["prefill_chunk"].default,
                     help="most prompt tokens computed in one step (as for strata serve)")
    gen.add_argument("--threads", type=int, default=None, help="BLAS and kernel threads (default: all cores)")
    gen.add_argument("--kv-type", choices=KV_TYPE_CHOICES, default=server["kv_type"].default,
                     help="how K/V is stored (as for strata serve)")
    gen.add_argument("--cpu-weights", choices=CPU_WEIGHTS, default=server["cpu_weights"].default,
                     help=server["cpu_weights"].description)
    gen.set_defaults(func=_cmd_generate)

    kernels = sub.add_parser("kernels", help="list the CUDA kernels; --check compiles them with NVRTC")
    kernels.add_argument("--check", action="store_true", help="compile every source and print registers, shared memory, spills")
    kernels.add_argument(
        "--arch", nargs="+", default=list(DEFAULT_ARCHS), metavar="SM",
        help=f"GPU archs to compile for ({' '.join(SUPPORTED_ARCHS)})",
    )
    kernels.set_defaults(func=_cmd_kernels)
    return parser


def _add_hf_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-hf", "--hf-repo", metavar="OWNER/REPO[:QUANT]", default=None,
                        help="llama-server's spelling of --model hf:OWNER/REPO[:QUANT]")


def _hf_as_model(args) -> None:
    """-hf OWNER/REPO:QUANT becomes the model hf:OWNER/REPO:QUANT; naming a model as well is ambiguous."""
    if args.hf_repo is None:
        return
    named = getattr(args, "name", None) or getattr(args, "model", None)  # pull's NAME, serve/generate's --model
    if named not in (None, default_model_name()):
        raise ValueError("-hf names the model: give either -hf or a model, not both")
    spec = "hf:" + args.hf_repo
    if hasattr(args, "name"):
        args.name = spec
    else:
        args.model = spec


def _cmd_serve(args) -> int:
    from api.logging_setup import configure_logging
    from api.serve import run_server

    _hf_as_model(args)
    config = config_from_args(args)
    configure_logging(config.log_format, config.log_level)
    return run_server(config)


def _cmd_kernels(args) -> int:
    from cuda_kernels import registry
    from cuda_kernels.build import NvrtcUnavailable, cache_dir
    from cuda_kernels.check import run_check

    if not args.check:
        for source, names in registry.SOURCES.items():
            print(f"{source}: {', '.join(names)}")
        return 0
    try:
        status = run_check(args.arch, sys.stdout, sys.stderr)
    except NvrtcUnavailable as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    print(f"kernel cache: {cache_dir()}", file=sys.stderr)
    return status


def _cmd_pull(args) -> int:
    if args.list:
        _print_model_list()
        return 0
    _hf_as_model(args)
    path = resolve_model(args.name)
    if not args.no_warm:
        _warm_kernels(path)
    print(path)
    return 0


def _warm_kernels(path) -> None:
    """Load the model on the numpy backend as `strata serve` does by default and run its warm-up once
    (engine/warmup.py), so that numba's disk cache holds the kernels its first server start needs."""
    from engine.kv import resolve_kv_type
    from engine.loader import open_model
    from engine.warmup import warm_model

    print(f"strata: compiling the CPU kernels of {path.name} into numba's disk cache (a minute or two the first "
          "time; --no-warm skips this)", file=sys.stderr)
    loaded = open_model(str(path), max_positions=4096, fetch=False)  # positions: only the RoPE table's size
    warm_model(loaded.model, resolve_kv_type("auto", loaded.model.backend))


def _print_model_list() -> None:
    from engine.model_store import list_known_models

    rows = [("name", "size", "context", "tools", "on disk", "description")]
    for entry in list_known_models():
        src = entry.source
        default = " (default)" if src.name == default_model_name() else ""
        rows.append((src.name + default, f"{src.size / MIB:.0f} MiB", f"{src.context_length}",
                     src.tool_format or "-", str(entry.path) if entry.on_disk else "no", src.description))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    from engine.model_list import list_local_models

    local = [("on disk (--model)", "size", "path")]
    local += [(m.spec, f"{m.size / MIB:.0f} MiB", str(m.path)) for m in list_local_models()]
    if len(local) == 1:
        print("\nno models in Ollama's store, LM Studio's folder or the Hugging Face cache")
        return
    print()
    widths = [max(len(row[i]) for row in local) for i in range(2)]
    for row in local:
        print(f"{row[0].ljust(widths[0])}  {row[1].rjust(widths[1])}  {row[2]}")


def _cmd_generate(args) -> int:
    from engine.cpu_threads import limit_threads
    from engine.generate import Completion, generate_stream
    from engine.loader import encode_chat_prompt, open_model
    from engine.kv import BLOCK_SIZE, blocks_needed, resolve_kv_type
    from engine.sequence import ModelRunner

    _hf_as_model(args)
    with limit_threads(args.threads or os.cpu_count() or 1):
        loaded = open_model(args.model, chat_template_path=args.chat_template, max_positions=args.ctx_size,
                            cpu_weights=args.cpu_weights)
        params = _generate_sampling(args, loaded.path)
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            text = loaded.chat_template.render(messages, add_generation_prompt=True)
            prompt_ids = encode_chat_prompt(loaded.tokenizer, text)
        else:
            prompt_ids = loaded.tokenizer.encode(args.prompt, add_special=True, parse_special=False)
        runner = ModelRunner(loaded.model, num_blocks=blocks_needed(args.ctx_size, BLOCK_SIZE), block_size=BLOCK_SIZE,
                             kv_type=resolve_kv_type(args.kv_type, loaded.model.backend))
        completion = Completion(prompt_ids)
        started = time.perf_counter()
        for delta in generate_stream(runner, loaded.tokenizer, prompt_ids, params, args.prefill_chunk, completion):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        elapsed = time.perf_counter() - started
    n_out = len(completion.token_ids)
    print(
        f"prompt {len(prompt_ids)} tokens, {n_out} generated in {elapsed:.2f} s "
        f"({n_out / max(elapsed, 1e-9):.1f} tok/s overall), finish_reason={completion.finish_reason}",
        file=sys.stderr,
    )
    return 0


def _generate_sampling(args, model_path):
    """The sampling flags given, the rest from the model's defaults (resolved as strata serve does)."""
    from api.sampling_defaults import load_sampling_defaults, resolve_params

    requested = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p",
                                                        "presence_penalty", "frequency_penalty", "seed")}
    return resolve_params({**requested, "stop": tuple(args.stop)}, load_sampling_defaults(model_path),
                          None, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
