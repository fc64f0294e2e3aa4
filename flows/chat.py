"""Chat with a registered model in the terminal; its answer streams token by token.

    python -m flows.chat --model models:/twinkle-SmolLM2-135M-Instruct.Q4_1@champion     # interactive
    python -m flows.chat --model models:/NAME@champion --message "Who are you?"           # one answer
    python -m flows.chat --model models:/NAME/3 --temperature 0.7                          # a version, sampled
    python -m flows.chat --model models:/NAME@champion --image cat.png --message "What is this?"  # a VL model

The registry is MLFLOW_TRACKING_URI's (default: mlflow.db in this folder). Greedy unless --temperature > 0.
`--image` (repeatable) goes with the first question to a vision-language model, encoded as its training rows
are (twinkle_core.data: the family's image processor and media tokens).
No Prefect run is started: this is a plain command line over twinkle_core.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows.cli import OptionParser
from twinkle_core.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OptionParser(prog="python -m flows.chat", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="models:/NAME@ALIAS or models:/NAME/VERSION")
    parser.add_argument("--message", help="ask this once, print the answer and exit (default: interactive)")
    parser.add_argument("--system", help="a system prompt before the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; above 0 samples")
    parser.add_argument("--image", action="append", default=[],
                        help="an image file for the first question (vision-language models; repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import TextStreamer

    from twinkle_core.data import RowError
    from twinkle_core.tracking.chat_model import chat_reply, media_encoder
    from twinkle_core.tracking.registered import opened_registered, parse_model_uri

    missing = [image for image in args.image if not Path(image).expanduser().is_file()]
    if missing:  # before the model loads
        print(f"chat: --image: no such file: {', '.join(missing)}", file=sys.stderr)
        return 1
    try:
        with opened_registered(*parse_model_uri(args.model)) as (model, tokenizer, folder):
            encoder = media_encoder(tokenizer, folder) if args.image else None
    except UserError as error:
        print(f"chat: {error}", file=sys.stderr)
        return 1
    if args.image and encoder is None:
        print(f"chat: --image: {args.model} is not a vision-language model (it takes text only)", file=sys.stderr)
        return 1
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    history = [{"role": "system", "content": args.system}] if args.system else []
    questions = [args.message] if args.message is not None else _typed_questions()
    for question in questions:
        images, args.image = [str(Path(image).expanduser().absolute()) for image in args.image], []
        content = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": question}]
        history.append({"role": "user", "content": content if images else question})
        try:
            answer = chat_reply(model, tokenizer, history, args.max_new_tokens, args.temperature, streamer, encoder)
        except RowError as error:  # an unreadable image: said before anything streams
            print(f"chat: --image: {error}", file=sys.stderr)
            return 1
        history.append({"role": "assistant", "content": answer})
    return 0


def _typed_questions():
    """Lines typed at the prompt, until an empty line, 'exit' or end of input."""
    print("Chat with the model (an empty line or 'exit' ends it).", flush=True)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            return
        if line in ("", "exit", "quit"):
            return
        print("model> ", end="", flush=True)
        yield line


if __name__ == "__main__":
    sys.exit(main())
