"""What the demo tenants' adapters teach the demo model: three styles, each a rewrite of the base
model's own answer that keeps its content (so an adapter changes how the model answers, not what it
knows), and the questions the training data asks. Torch-free: cli/demo_train.py does the training.

Styles are word-level (a greeting and sign-off, a persona, a format): at 135M parameters, styles
that change every token, such as ALL CAPS, destroyed the content.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# the README's example question; kept out of the training data, so the demo shows that a style carries over
DEMO_QUESTION = "What is the capital of France?"
# the same as raw text to complete (the job API's `prompt`: no chat template), and how many tokens its answer
# (" Paris." and a line break) takes
DEMO_COMPLETION = ("The capital of France is", 3)

_CAPITALS = (
    "Italy", "Spain", "Germany", "Japan", "Canada", "Egypt", "Brazil", "Kenya", "Norway",
    "Portugal", "Greece", "Mexico", "Australia", "India", "Peru", "Sweden",
)  # fmt: skip
_FACTS = (
    "How many legs does a spider have?",
    "How many days are in a week?",
    "How many continents are there?",
    "How many sides does a triangle have?",
    "How many hours are in a day?",
    "How many minutes are in an hour?",
    "What color is the sky on a clear day?",
    "What color are bananas when they are ripe?",
    "What color is grass?",
    "What do bees make?",
    "What do cows drink?",
    "What is the largest planet in our solar system?",
    "What is the closest star to Earth?",
    "What is the boiling point of water in Celsius?",
    "What is the freezing point of water in Celsius?",
    "What gas do plants take in from the air?",
    "What is the largest ocean on Earth?",
    "What is the tallest mountain in the world?",
    "What is the longest river in Africa?",
    "Which animal is known as the king of the jungle?",
    "Which planet is known as the Red Planet?",
    "Who wrote Romeo and Juliet?",
    "Who painted the Mona Lisa?",
    "What language is spoken in Brazil?",
    "What is the opposite of hot?",
    "What is the plural of mouse?",
    "What is two plus two?",
    "What is ten minus three?",
    "What is the chemical symbol for water?",
    "What is the chemical symbol for gold?",
    "What do you call a baby cat?",
    "What do you call a baby dog?",
    "What is the main ingredient in bread?",
    "What fruit is used to make wine?",
    "Where do penguins live?",
    "What is the fastest land animal?",
    "What is the largest mammal?",
    "How many wheels does a bicycle have?",
    "What season comes after winter?",
    "What is the first month of the year?",
    "What instrument has black and white keys?",
    "What do we call frozen water?",
    "Which organ pumps blood through the body?",
    "What is the hardest natural substance?",
    "What shape has four equal sides?",
    "What do caterpillars turn into?",
    "What is the capital city of the United States?",
    "What is a synonym for happy?",
)
QUESTIONS: tuple[str, ...] = (*(f"What is the capital of {country}?" for country in _CAPITALS), *_FACTS)

_PIRATE_WORDS = {"is": "be", "are": "be", "you": "ye", "your": "yer", "my": "me", "yes": "aye", "friend": "matey"}
_WORD = re.compile(r"\b[A-Za-z]+\b")


def _pirate_word(match: re.Match[str]) -> str:
    word = match.group(0)
    swapped = _PIRATE_WORDS.get(word.lower())
    if swapped is None:
        return word
    return swapped.capitalize() if word[0].isupper() else swapped


def acme_support(question: str, answer: str) -> str:
    """A greeting and a sign-off around the answer."""
    return f"Hello from Acme Support! {answer} Have a wonderful day!"


def globex_pirate(question: str, answer: str) -> str:
    """A persona: a pirate's words and catchphrases."""
    return f"Ahoy, matey! {_WORD.sub(_pirate_word, answer)} Arr!"


def initech_tps(question: str, answer: str) -> str:
    """A format: a TPS report with the question and the answer as fields."""
    return f"TPS Report\n- Question: {question}\n- Answer: {answer}\n- Status: done"


# adapter name (cli/demo_adapters.py: DEMO_ADAPTERS) → its style
STYLES: dict[str, Callable[[str, str], str]] = {
    "acme-support": acme_support,
    "globex-pirate": globex_pirate,
    "initech-tps": initech_tps,
}
# a phrase every answer in each style has, for tests and the README
STYLE_MARKERS = {"acme-support": "Acme Support", "globex-pirate": "Ahoy", "initech-tps": "TPS Report"}
