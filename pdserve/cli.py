"""The `pdserve` command line. Flags and environment variables are read here and nowhere else.

    pdserve fetch-model                      download and verify the default model (no-op when present)
    pdserve generate "PROMPT" [options]      complete a raw prompt, streaming the text
    pdserve chat ["MESSAGE"] [options]       one chat turn (or an interactive session without MESSAGE)

Environment: PDSERVE_HOME sets the model cache directory (default ~/.cache/pdserve).
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import DTYPES


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default",
                   help="a .gguf file, a Hugging Face directory, or 'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion in tokens")
    g.add_argument("--kv-cache-memory", type=int, default=512 * 2**20, help="KV-cache budget in bytes")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--threads", type=int, default=None, help="CPU threads for this process")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("fetch-model", help="download and verify the default model")

    gen = sub.add_parser("generate", help="complete a raw prompt")
    gen.add_argument("prompt")
    _engine_args(gen)
    _sampling_args(gen)

    chat = sub.add_parser("chat", help="chat with the model")
    chat.add_argument("message", nargs="?", help="one message; omit for an interactive session")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_args(chat)
    _sampling_args(chat)
    return parser


def _make_llm(args: argparse.Namespace):
    from engine.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads)


def _sampling(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          repetition_penalty=args.repetition_penalty)


def _print_stream(chunks) -> str:
    text = []
    for delta in chunks:
        text.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(text)


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from engine.model_fetch import fetch_default_model

    print(fetch_default_model())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    _print_stream(llm.stream(args.prompt, _sampling(args)))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        messages.append({"role": "assistant", "content": _print_stream(llm.stream(prompt, params))})

    if args.message is not None:
        turn(args.message)
        return 0
    while True:
        try:
            text = input("> ")
        except EOFError:
            return 0
        if text.strip():
            turn(text)


COMMANDS = {"fetch-model": cmd_fetch_model, "generate": cmd_generate, "chat": cmd_chat}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.errors import InvalidRequestError
    from engine.model_fetch import ModelFetchError

    try:
        return COMMANDS[args.command](args)
    except (InvalidRequestError, ModelFetchError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
