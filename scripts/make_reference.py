"""Regenerate ``tests/data/{smollm2,gemma3}_reference.json`` from transformers.

Runs a real GGUF model through transformers (float32, CPU, weights
dequantised from the GGUF by transformers' own loader) and records, for a few
prompts: the transformers token ids, the greedy tokens (48 for smollm2, 32 for
gemma3-270m), and top-5 (token id, logit) pairs at selected positions.
strata's tests compare their numpy engine against these files without torch.

Usage::

    python scripts/make_reference.py [--model smollm2|gemma3-270m]
                                     [--gguf PATH] [--out PATH] [--n-new N]

The GGUF defaults to ``$STRATA_SMOLLM2_GGUF`` / ``$STRATA_GEMMA3_GGUF`` or
else the file strata's model store resolves (and fetches) for ``--model``.
Needs the ``reference`` extra (torch, transformers) and strata importable
(the script puts the repository root on ``sys.path``): every prompt's
transformers ids must equal strata's tokenizer output, or the script stops.
Digits preceded by a space are avoided in the plain-text prompts: llama.cpp's
``smollm`` pre-tokenizer and transformers' GGUF tokenizer may split them
differently. The gemma3 prompts are plain text with the BOS the tokenizer
adds; ``long_lighthouses`` (724 tokens) is longer than gemma3-270m's sliding
window (512), so the reference exercises the sliding-window layers.

JSON layout (``prompts`` is a list of these)::

    name, text, prompt_ids, greedy_ids, greedy_text,
    step_top5:   9 entries; entry k holds the top-5 [id, logit] of the logits
                 that predict greedy_ids[k], i.e. k=0 is the last prompt
                 position and k=1..8 are the first 8 generated positions
                 (computed in one full forward pass over prompt + greedy ids);
    prompt_top5: {"<pos>": top-5} for 3 prompt positions (logits at that
                 position, i.e. predicting token pos+1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, REPO)  # for engine.tokenizer / engine.model_store
from hf_reference import hf_greedy, hf_logits  # noqa: E402

CHAT_USER = "What is the capital of France?"
CHAT_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n<|im_start|>user\n" + CHAT_USER
    + "<|im_end|>\n<|im_start|>assistant\n")

CODE_TEXT = (
    "def greet(name):\n"
    "    message = \"Hello, \" + name + \"!\"\n"
    "    print(message)\n"
    "    return message\n\n"
    "for person in [\"Alice\", \"Bob\", \"Carol\"]:\n"
    "    ")

SENTENCE_TEXT = "The quick brown fox jumps over the lazy dog, and then it"

PARAGRAPH_TEXT = (
    "The printing press changed the way people shared ideas across Europe. Before "
    "its invention, books were copied by hand, usually by monks working in quiet "
    "monasteries, and a single volume could take many months to finish. Because "
    "of this, books were rare and expensive, and only wealthy families, churches "
    "and universities could afford to own them. When Johannes Gutenberg developed "
    "a press with movable metal type in the German city of Mainz, he made it "
    "possible to produce hundreds of identical pages in the time it once took to "
    "copy a few. Printers soon opened workshops in Venice, Paris, London and many "
    "other cities. Pamphlets, calendars, grammars and maps spread quickly, and "
    "scholars in distant countries could read the same text and argue about the "
    "same passages. Literacy slowly increased as printed material became cheaper, "
    "and ordinary merchants began to keep written records and to read news about "
    "prices, wars and discoveries. The new technology also helped standardize "
    "spelling and grammar, since printers chose one form of each word and repeated "
    "it in thousands of copies. Religious reformers used the press to publish "
    "their arguments in the language of the people rather than in Latin, which "
    "allowed their ideas to travel far beyond the reach of any single preacher. "
    "Scientists shared careful drawings of plants, animals and the human body, "
    "and astronomers compared tables of observations gathered in different "
    "places. In many ways, the printing press laid the foundation for the modern "
    "world, in which information moves freely and quickly between people who will "
    "never meet. Historians still debate how")

LONG_TEXT = (
    'Lighthouses have guided sailors along dangerous coasts for a very long '
    'time. The earliest ones were simple fires burning on hilltops or on the '
    'roofs of tall buildings near a harbor, and their keepers had to carry '
    'wood or oil up steep paths every evening. A ship approaching at night '
    'could see the glow from far away and know that land, and perhaps safety, '
    'was near. Over the centuries these fires were replaced by towers of stone '
    'and brick, built on rocky islands, narrow headlands and sandbars where '
    'many vessels had already been lost.\n\nBuilding such a tower was never '
    'easy. Engineers had to work on exposed rocks that were covered by the sea '
    'at high tide, so the workers could only lay stones for a few hours each '
    'day. Waves smashed their equipment, storms delayed the work for weeks, '
    'and the granite blocks had to be shaped on the mainland and carried out '
    'by boat. Some designers cut each block so that it locked into its '
    'neighbors like the pieces of a puzzle, which made the finished tower '
    'strong enough to resist the heaviest seas. When a new light was finally '
    'lit, the people of the nearby towns often gathered on the shore to watch.\n'
    '\nThe light itself changed as well. Candles and oil lamps gave way to '
    'brighter burners, and clever systems of mirrors and glass lenses gathered '
    'the light into powerful beams. A large lens could send a beam across the '
    'water for many miles, much farther than an open flame. To help sailors '
    'tell one lighthouse from another, each station was given its own pattern: '
    'one might flash twice and then stay dark, another might shine steadily, '
    'and a third might show a red sector over a hidden reef. Captains carried '
    'lists of these patterns and checked them carefully whenever a light '
    'appeared on the horizon.\n\nLife for the keepers was often lonely and hard. '
    'They climbed the spiral stairs many times each night to trim the wicks, '
    'polish the lenses and wind the clockwork that turned the great lamp. On '
    'remote islands, supply boats might not arrive for a month if the weather '
    'was bad, so families kept gardens, raised goats and stored food for the '
    'winter. Children learned their lessons at the kitchen table, and the '
    'keepers wrote daily reports about the wind, the fog and the ships that '
    'passed. In thick fog they rang bells or sounded horns for hours without '
    'rest, because a light alone could not be seen through the grey curtain '
    'that covered the sea.\n\nMany keepers became local heroes. When a ship ran '
    'aground near their station, they rowed out in small boats through '
    'breaking waves to rescue the crew, and some of these rescues were '
    'remembered in songs and stories for generations. Others are remembered '
    'for quieter reasons: for the careful journals they kept, for the birds '
    'and plants they described, or for the simple fact that their light never '
    'failed during long and violent storms.\n\nToday most lighthouses are '
    'automatic. Electric lamps switch on by themselves when the evening grows '
    'dark, and satellites help ships find their position with great accuracy, '
    'so the old towers are no longer as important as they once were. Yet '
    'people still love them. Some have become museums, where visitors can '
    'climb the stairs and look out over the water, while others serve as small '
    'hotels or as homes for artists and writers. Communities raise money to '
    'repair cracked walls and rusted railings, and volunteers paint the towers '
    'in their traditional colors every few years. Standing at the top of one '
    'of these old buildings, with the wind in your face and the waves far '
    'below, it is easy to imagine the keepers who once lived there and the '
    'sailors who depended on their light. Perhaps that is why, even in an age '
    'of')

# Per model: GGUF env override, output file, default n_new, prompts, the chat
# prompt to check against the GGUF's template (or None), and whether strata's
# tokenizer adds the BOS itself (``encode(text, add_special=...)``).
MODELS = {
    "smollm2": {
        "env": "STRATA_SMOLLM2_GGUF", "out": "smollm2_reference.json", "n_new": 48,
        "chat": (CHAT_USER, CHAT_TEXT), "add_special": False,
        "prompts": [
            ("chat_capital_france", CHAT_TEXT),
            ("code_python", CODE_TEXT),
            ("sentence_fox", SENTENCE_TEXT),
            ("paragraph_printing_press", PARAGRAPH_TEXT),
        ],
    },
    "gemma3-270m": {
        "env": "STRATA_GEMMA3_GGUF", "out": "gemma3_reference.json", "n_new": 32,
        "chat": None, "add_special": True,
        "prompts": [
            ("sentence_fox", SENTENCE_TEXT),
            ("code_python", CODE_TEXT),
            ("long_lighthouses", LONG_TEXT),
        ],
    },
}


def topk(row: np.ndarray, k: int = 5) -> list[list]:
    """Top-``k`` ``[token_id, logit]`` pairs of one logits row, best first."""
    idx = np.argsort(-row, kind="stable")[:k]
    return [[int(i), round(float(row[i]), 4)] for i in idx]


def sha256(path: str) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_gguf(model: str) -> str:
    """``$STRATA_<MODEL>_GGUF`` if set, else strata's cached (fetched) file."""
    env = os.environ.get(MODELS[model]["env"])
    if env:
        return env
    from engine.model_store import resolve_model

    return str(resolve_model(model))


def build_reference(gguf_path: str, n_new: int | None = None,
                    model: str = "smollm2") -> dict:
    """Compute the reference dict for ``gguf_path`` (see module docstring)."""
    import torch
    import transformers
    import gguf
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    spec = MODELS[model]
    n_new = spec["n_new"] if n_new is None else n_new
    dirname, basename = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(dirname, gguf_file=basename)
    if spec["chat"] is not None:
        user, expected = spec["chat"]
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False,
            add_generation_prompt=True)
        assert rendered == expected, repr(rendered)
    strata_tok = Tokenizer.from_gguf_path(gguf_path)

    prompts = []
    for name, text in spec["prompts"]:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        ours = strata_tok.encode(text, add_special=spec["add_special"], parse_special=True)
        assert ours == list(ids), f"{name}: strata and transformers tokenize differently"
        greedy = hf_greedy(gguf_path, ids, n_new)
        logits = hf_logits(gguf_path, ids + greedy[:8])
        T = len(ids)
        steps = [topk(logits[T - 1 + k]) for k in range(9)]
        # full-forward argmax must agree with the cached greedy decode
        assert [s[0][0] for s in steps] == greedy[:9], name
        positions = [0, T // 2, T - 2]
        prompts.append({
            "name": name,
            "text": text,
            "prompt_ids": [int(i) for i in ids],
            "greedy_ids": [int(i) for i in greedy],
            "greedy_text": tok.decode(greedy),
            "step_top5": steps,
            "prompt_top5": {str(p): topk(logits[p]) for p in positions},
        })
        print(f"{name}: {T} prompt tokens -> {tok.decode(greedy)!r}", file=sys.stderr)

    return {
        "model": basename,
        "gguf_sha256": sha256(gguf_path),
        "source": "transformers GGUF loader, float32 CPU, greedy argmax, no EOS stop",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
            "numpy": np.__version__,
        },
        "n_new": n_new,
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "prompts": prompts,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write the reference JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--gguf", default=None, help="default: see module docstring")
    ap.add_argument("--out", default=None,
                    help="default: tests/data/<smollm2|gemma3>_reference.json")
    ap.add_argument("--n-new", type=int, default=None,
                    help="greedy tokens (default: 48 smollm2, 32 gemma3-270m)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(REPO, "tests", "data", MODELS[args.model]["out"])
    ref = build_reference(args.gguf or default_gguf(args.model), args.n_new, args.model)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    text = json.dumps(ref, indent=1, ensure_ascii=False)
    # keep number-only arrays (ids, [id, logit] pairs) on one line
    text = re.sub(r"\[[-0-9.,\s]*\]",
                  lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)
    # ... and lists of [id, logit] pairs too
    text = re.sub(r"\[\s*(\[[-0-9., ]*\],?\s*)+\]",
                  lambda m: re.sub(r"\s+", "", m.group(0)).replace(",[", ", ["), text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
