"""Synthetic chat prompts (topics x tasks, seeded) for runs with no dataset download:
the SmolLM2 demo and the benchmark. `python -m workers.prompts OUT N [--seed S]`."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

TOPICS = [
    "the water cycle", "photosynthesis", "binary search", "hash tables", "the French "
    "Revolution", "black holes", "vaccines", "compound interest", "recursion", "plate "
    "tectonics", "the immune system", "supply and demand", "neural networks", "sorting "
    "algorithms", "climate change", "the Roman Empire", "DNA replication", "electric "
    "circuits", "gravity", "the stock market", "prime numbers", "linked lists", "volcanoes",
    "the human heart", "inflation", "solar panels", "the printing press", "operating "
    "systems", "coral reefs", "probability", "the moon landing", "sleep", "habits",
    "public speaking", "time management", "bread baking", "composting", "rainbows",
    "earthquakes", "the internet", "encryption", "databases", "version control", "unit "
    "testing", "the Pythagorean theorem", "fractions", "vitamins", "exercise", "meditation",
    "recycling", "bees", "the ocean tides", "magnets", "the periodic table", "renewable "
    "energy", "the Renaissance", "chess openings", "learning a language", "budgeting",
    "job interviews", "writing an essay", "Python lists", "SQL joins", "HTTP", "caching",
    "memory leaks", "the scientific method", "evolution", "antibiotics", "the speed of "
    "light", "airplanes", "batteries", "coffee", "tea", "deserts", "rain forests", "glaciers",
]
TASKS = [
    "Explain {t} to a ten-year-old.", "Give three facts about {t}.", "Why does {t} matter?",
    "Write a short paragraph about {t}.", "What are common misconceptions about {t}?",
    "Summarize {t} in two sentences.", "List the key terms one should know about {t}.",
    "How would you teach {t} in five minutes?", "Write a haiku about {t}.",
    "What is the history of {t}, briefly?", "Give a simple example that shows {t}.",
    "Compare {t} with something from everyday life.", "What questions do people ask "
    "about {t}?", "Write a step by step explanation of {t}.", "What are the pros and cons "
    "of {t}?", "Describe {t} in one paragraph for a newsletter.", "What would a beginner "
    "get wrong about {t}?", "Give me a quiz question about {t} and its answer.",
    "Explain {t} using an analogy.", "Write a tweet about {t}.", "What is the most "
    "surprising thing about {t}?", "How is {t} used in practice?", "Tell a short story "
    "that involves {t}.", "What should I read to learn more about {t}?",
    "Explain {t} in simple words.", "Write three bullet points on {t}.",
    "What problem does {t} solve?", "How has {t} changed over time?",
    "Give a one-sentence definition of {t}.", "What are two examples of {t}?",
    "Explain how {t} works, step by step.", "Write a short dialogue about {t}.",
    "What do experts disagree about regarding {t}?", "Why is {t} hard to understand?",
    "Describe {t} to someone from the year 1800.", "Write a limerick about {t}.",
    "What are the main parts of {t}?", "How can I explain {t} at a dinner party?",
]


def prompt_texts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct prompts, in a seeded order."""
    pairs = [(topic, task) for topic in TOPICS for task in TASKS]
    if n > len(pairs):
        raise ValueError(f"at most {len(pairs)} distinct prompts, not {n}")
    random.Random(seed).shuffle(pairs)
    return [task.format(t=topic) for topic, task in pairs[:n]]


def write_prompts(path: Path, texts: list[str], id_prefix: str = "p") -> Path:
    """One `{"id", "messages"}` record per prompt (what workers.generate reads)."""
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"{id_prefix}{i:05d}",
                                "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.prompts", description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("n", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        write_prompts(args.out, prompt_texts(args.n, args.seed))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


