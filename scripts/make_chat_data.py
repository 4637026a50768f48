"""Writes the bundled synthetic chat data (torchtitan_amp/data/bundled/chat_{train,val}.jsonl):
short conversations a debug model can learn in minutes (arithmetic, word reversal, upper case,
counting letters), some with a system message, some with two user turns. Deterministic: a seeded
random.Random, so rerunning it rewrites the same bytes.

    python scripts/make_chat_data.py [--out-dir torchtitan_amp/data/bundled] [--train 400] [--val 50]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "apple river stone cloud tiger paper music green light quiet table north window garden silver "
    "bread candle forest yellow planet"
).split()
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a careful calculator.")


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the word {word}.", f"{word} reversed is {word[::-1]}."


def _upper(rng: random.Random) -> tuple[str, str]:
    words = " ".join(rng.sample(WORDS, 2))
    return f"Write in capitals: {words}", words.upper()


def _count(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters."


TASKS = (_add, _reverse, _upper, _count)


def conversation(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One conversation: an optional system message, then one or two user/assistant exchanges."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(1 if rng.random() < 0.7 else 2):
        question, answer = rng.choice(TASKS)(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "torchtitan_amp/data/bundled"))
    p.add_argument("--train", type=int, default=400, help="training conversations")
    p.add_argument("--val", type=int, default=50, help="held-out conversations")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, count in (("chat_train.jsonl", args.train), ("chat_val.jsonl", args.val)):
        lines = [json.dumps(conversation(rng)) + "\n" for _ in range(count)]
        (out / name).write_text("".join(lines), encoding="utf-8")
        print(f"wrote {count} conversations to {out / name}")


if __name__ == "__main__":
    main()
