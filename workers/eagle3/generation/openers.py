"""The first words of a user turn, for the target to go on from (`--prompt-openers`).

A small chat model left to write its requests from the bare pre-query template writes
mostly one kind. SmolLM2-135M-Instruct, 256 samples at temperature 1 (CPU): one accepted
prompt in five is "I'm planning / considering ... can you help me?", hardly any asks for
code, a sum, a story, a role or something taken out of a text, and the held-out
hand-written questions, which do, are where its drafts fall short (docs/benchmarks.md,
#29). Starting a turn with a request's first words ("Write a Python function",
"Solve", "Pretend you are") has the target write the rest of such a request in its own
words: the opener picks the kind, the target writes everything else. These openers are
the first words of requests of every kind a chat assistant is asked (MT-Bench's eight
categories and everyday ones), written for jobsup, not taken from any dataset.
"""

from __future__ import annotations

from pathlib import Path

WRITING = (
    "Write a short story", "Write a poem", "Write a blog post", "Write an email",
    "Write a letter", "Write a product description", "Draft a", "Compose a",
    "Rewrite the following", "Edit this paragraph", "Write a persuasive essay",
    "Write a speech", "Write a review of", "Come up with a slogan", "Write a dialogue",
    "Write the opening paragraph", "Suggest a title",
)
ROLE_PLAY = (
    "Pretend you are", "Act as", "Imagine you are", "You are a", "Role-play as",
    "Let's play a game.", "Take on the role of", "As a", "Respond as if you were",
)
REASONING = (
    "If", "Which of the following", "Is it true that", "Why does", "What would happen if",
    "Suppose", "There are", "A man", "Three friends", "Explain the logic",
    "What is wrong with this argument", "Find the pattern",
)
MATH = (
    "Solve", "Calculate", "What is the derivative", "Find the value of", "Prove that",
    "How many", "Simplify", "What is the probability", "Compute",
    "Evaluate the integral", "The sum of",
)
CODING = (
    "Write a Python function", "Write a function", "Write a SQL query", "Debug this code",
    "What does this code do", "Implement", "Write a JavaScript", "How do I", "Write a bash",
    "Explain the difference between", "Refactor", "Write a C++ program",
    "Write a regular expression", "Fix the bug", "Write a class",
)
EXTRACTION = (
    "Extract", "Summarize the following", "List all the",
    "Identify the", "Given the following", "Read the passage", "Classify",
    "Convert the following", "Parse",
)
STEM = (
    "Explain", "How does", "What is the difference between", "Describe the process",
    "What causes", "In physics,", "Why is", "How do", "What are the main",
    "Describe how",
)
HUMANITIES = (
    "Discuss", "Analyze", "What were the causes", "Compare", "Evaluate",
    "What is the significance", "Who was", "In economics,", "Describe the history",
    "How did", "What role did",
)
EVERYDAY = (
    "Give me", "What should I", "Can you recommend", "Help me plan", "I need",
    "What are some tips", "Tell me", "Create a", "Suggest", "Translate",
)

BUILTIN: tuple[str, ...] = (*WRITING, *ROLE_PLAY, *REASONING, *MATH, *CODING, *EXTRACTION,
                            *STEM, *HUMANITIES, *EVERYDAY)
"""The openers `--prompt-openers builtin` draws from, uniformly."""


def starts_with_opener(text: str, openers: tuple[str, ...]) -> str | None:
    """The opener `text` starts with as whole words ("If" starts "If 3 painters", not
    "Iffy"), or None: held-out questions that share an opener with the training prompts
    are reported apart from the rest."""
    for opener in openers:
        if text.startswith(opener) and (len(text) == len(opener)
                                        or not text[len(opener)].isalnum()):
            return opener
    return None


def read_openers(spec: str) -> tuple[str, ...]:
    """`builtin`, `none` (no opener: every turn written from the bare template) or a text
    file of one opener per line (blank lines and `#` lines skipped). Raises ValueError
    when a file holds none or cannot be read."""
    if spec == "builtin":
        return BUILTIN
    if spec == "none":
        return ()
    try:
        lines = Path(spec).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompt-openers {spec}: {exc}") from None
    openers = tuple(line.strip() for line in lines
                    if line.strip() and not line.lstrip().startswith("#"))
    if not openers:
        raise ValueError(f"--prompt-openers {spec}: no opener in the file")
    return openers
