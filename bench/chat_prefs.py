"""Deterministic chat preference rows for a real small chat model (bench/readme_recipe.py's data).

    python bench/chat_prefs.py [OUT.jsonl] [--rows 360] [--seed 0]   # default bench/out/data/chat-prefs.jsonl

Conversational rows, so the model's chat template applies: prompt [{"role": "user", ...}], chosen and rejected
[{"role": "assistant", ...}]. The preference is one users want and a 135M chat model can learn: a helpful, direct,
correct answer over
- a wrong one (the same sentence with a wrong fact: another capital, a sum off by a few, a wrong plural, ...),
- a curt refusal ("I'm sorry, but I can't help with that."), or
- an off-topic ramble (a sentence or two about something else).
Ten families of questions (capitals, sums and differences, opposites, plurals, legs of animals, the next day or
month, colours, unit conversions, everyday tips, one-line definitions), each asked in 2-4 phrasings, so every
prompt is a distinct text and the prompts eval_fraction holds out are new ones. A held-out prompt may ask a fact
a training prompt asked in other words (as in real data); the refusals and rambles it is paired with are drawn
from the same pools with random fillers. rows_and_facts gives each row's fact too (the word or number a right
answer states), and states(answer, fact) judges a model's answer by it. No download: seeded `random`, the same n and seed give the same rows.
Short: with SmolLM2's chat template (its 20-token system line included) prompt + answer is under ~80 tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

DEFAULT_PATH = Path("bench/out/data/chat-prefs.jsonl")
DEFAULT_ROWS = 360

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Chile", "Santiago"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Portugal", "Lisbon"),
            ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Russia", "Moscow"),
            ("China", "Beijing"), ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
            ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"), ("Cuba", "Havana"), ("Turkey", "Ankara"),
            ("Iran", "Tehran"), ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Switzerland", "Bern"),
            ("South Korea", "Seoul"), ("Indonesia", "Jakarta"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"),
            ("Colombia", "Bogota"), ("Ukraine", "Kyiv"), ("the Netherlands", "Amsterdam")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("light", "dark"),
             ("open", "closed"), ("happy", "sad"), ("early", "late"), ("full", "empty"), ("wet", "dry"),
             ("old", "young"), ("hard", "soft"), ("loud", "quiet"), ("rich", "poor"), ("strong", "weak"),
             ("tall", "short"), ("thick", "thin"), ("clean", "dirty"), ("heavy", "light"), ("near", "far"),
             ("win", "lose"), ("buy", "sell"), ("push", "pull"), ("first", "last"), ("inside", "outside"),
             ("true", "false"), ("cheap", "expensive"), ("safe", "dangerous"), ("begin", "end"), ("day", "night")]
PLURALS = [("mouse", "mice", "mouses"), ("child", "children", "childs"), ("foot", "feet", "foots"),
           ("tooth", "teeth", "tooths"), ("man", "men", "mans"), ("woman", "women", "womans"),
           ("goose", "geese", "gooses"), ("person", "people", "persons"), ("box", "boxes", "boxs"),
           ("city", "cities", "citys"), ("leaf", "leaves", "leafs"), ("knife", "knives", "knifes"),
           ("wolf", "wolves", "wolfs"), ("sheep", "sheep", "sheeps"), ("bus", "buses", "buss"),
           ("baby", "babies", "babys"), ("ox", "oxen", "oxes"), ("cactus", "cacti", "cactuss"),
           ("half", "halves", "halfs"), ("potato", "potatoes", "potatos"), ("fish", "fish", "fishes"),
           ("life", "lives", "lifes"), ("church", "churches", "churchs"), ("party", "parties", "partys")]
LEGS = [("spider", 8), ("dog", 4), ("bird", 2), ("ant", 6), ("cat", 4), ("horse", 4), ("chicken", 2), ("bee", 6),
        ("duck", 2), ("cow", 4), ("beetle", 6), ("goat", 4), ("penguin", 2), ("butterfly", 6), ("scorpion", 8),
        ("rabbit", 4), ("ostrich", 2), ("grasshopper", 6), ("tick", 8), ("lion", 4)]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
COLOURS = [("the sky on a clear day", "blue"), ("fresh grass", "green"), ("fresh snow", "white"),
           ("a ripe banana", "yellow"), ("a ripe tomato", "red"), ("coal", "black"), ("a lemon", "yellow"),
           ("a strawberry", "red"), ("milk", "white"), ("a carrot", "orange"), ("a pumpkin", "orange"),
           ("a lime", "green"), ("chocolate", "brown"), ("a crow", "black"), ("a polar bear", "white"),
           ("a cherry", "red"), ("an emerald", "green"), ("the ocean on a sunny day", "blue")]
COLOUR_NAMES = ["blue", "green", "white", "yellow", "red", "black", "orange", "brown", "purple", "pink", "grey"]
UNITS = [("minutes", "hour", "hours", 60), ("seconds", "minute", "minutes", 60), ("days", "week", "weeks", 7),
         ("months", "year", "years", 12), ("centimetres", "metre", "metres", 100),
         ("grams", "kilogram", "kilograms", 1000), ("hours", "day", "days", 24)]
# (a noun phrase for "tips for ...", a verb phrase for "how can I ...", a helpful one- or two-sentence answer)
TIPS = [("sleeping better", "sleep better", "Go to bed at the same time every night and put screens away an hour "
         "before bed."),
        ("saving money", "save money", "Write down what you spend for a month, then set a small amount aside on "
         "each payday before you spend anything."),
        ("learning a language", "learn a new language", "Practise a little every day, and speak with native "
         "speakers as early as you can."),
        ("staying focused", "stay focused", "Work in 25-minute blocks with short breaks, and silence your phone "
         "while you work."),
        ("running a first 5k", "train for my first 5k", "Start with run-walk intervals three times a week and "
         "add a few minutes of running each week."),
        ("cooking rice", "cook fluffy rice", "Rinse the rice, use about one and a half cups of water per cup, "
         "and let it rest covered for ten minutes after cooking."),
        ("writing an email to a boss", "write a clear email to my boss", "Put the request in the first line, "
         "keep it short, and end with the next step you need."),
        ("keeping houseplants alive", "keep my houseplants alive", "Water only when the top of the soil is dry, "
         "and give them bright light without harsh afternoon sun."),
        ("preparing for a job interview", "prepare for a job interview", "Read about the company, and practise "
         "short answers about your past work out loud."),
        ("drinking more water", "drink more water", "Keep a full bottle on your desk and drink a glass with every "
         "meal."),
        ("reducing stress", "reduce stress", "Take a short walk outside each day and slow your breathing for a "
         "minute when you feel tense."),
        ("studying for an exam", "study for an exam", "Test yourself with practice questions instead of rereading "
         "your notes, and spread the work over several days."),
        ("making new friends", "make new friends", "Join a club or class about something you enjoy and go every "
         "week, so the same people see you often."),
        ("waking up early", "wake up earlier", "Move your alarm fifteen minutes earlier each week and open the "
         "curtains as soon as you get up."),
        ("packing for a trip", "pack light for a trip", "Lay out everything you want to bring, then put back half "
         "of the clothes."),
        ("eating more vegetables", "eat more vegetables", "Add one vegetable to every meal you already eat, such "
         "as spinach in eggs or carrots with lunch."),
        ("giving a short speech", "give a short speech", "Open with one clear point, rehearse it out loud three "
         "times, and speak slower than feels natural."),
        ("keeping a tidy desk", "keep my desk tidy", "Clear the desk for two minutes at the end of each day and "
         "keep only what you use daily on it."),
        ("fixing a slow computer", "speed up my slow computer", "Close programs you are not using, remove apps "
         "that start at login, and restart it."),
        ("remembering names", "remember people's names", "Repeat the name when you are introduced and use it "
         "once more before the conversation ends."),
        ("writing a cover letter", "write a good cover letter", "Say which job you want in the first line, then "
         "give two examples of work that fits it."),
        ("stretching after a run", "stretch after running", "Hold calf, thigh and hip stretches for about thirty "
         "seconds each while you are still warm."),
        ("baking bread", "bake my first loaf of bread", "Weigh the flour and water, knead until the dough is "
         "smooth, and let it double in size before baking."),
        ("learning to type faster", "type faster", "Keep your fingers on the home row and practise ten minutes a "
         "day without looking at the keys.")]
DEFINITIONS = [("a volcano", "A volcano is an opening in the Earth's crust where melted rock, ash and gas escape."),
               ("photosynthesis", "Photosynthesis is how plants use sunlight, water and carbon dioxide to make "
                "sugar and oxygen."),
               ("a noun", "A noun is a word that names a person, place, thing or idea."),
               ("gravity", "Gravity is the force that pulls objects with mass toward each other."),
               ("a verb", "A verb is a word for an action or a state, such as run or be."),
               ("a mammal", "A mammal is a warm-blooded animal with hair that feeds its young with milk."),
               ("an atom", "An atom is the smallest unit of a chemical element."),
               ("a budget", "A budget is a plan for how much money you will earn and spend."),
               ("a planet", "A planet is a large body that orbits a star, like the Earth around the Sun."),
               ("a password", "A password is a secret word or phrase that proves who you are to a computer."),
               ("evaporation", "Evaporation is when a liquid turns into a gas, like water drying in the sun."),
               ("a triangle", "A triangle is a flat shape with three straight sides and three corners."),
               ("a glacier", "A glacier is a large, slow-moving mass of ice on land."),
               ("a recipe", "A recipe is a list of ingredients and steps for cooking a dish."),
               ("an island", "An island is a piece of land with water all around it."),
               ("a fraction", "A fraction is a part of a whole, written as one number over another, like 1/2."),
               ("a library", "A library is a place where you can borrow books and other media for free."),
               ("an election", "An election is a vote in which people choose who will represent them."),
               ("a habit", "A habit is something you do regularly, often without thinking about it."),
               ("a thermometer", "A thermometer is a tool that measures temperature."),
               ("a desert", "A desert is a place that gets very little rain each year."),
               ("a vaccine", "A vaccine trains the immune system to recognise a germ so the body can fight it.")]

REFUSALS = ["I'm sorry, but I can't help with that.", "I can't answer that.", "No.", "I'd rather not say.",
            "That's not something I can help with.", "Ask someone else.", "I don't answer questions like this.",
            "Sorry, I won't do that.", "Look it up yourself.", "I'm not able to answer that question."]
RAMBLE_TOPICS = ["my cousin's wedding", "the weather last Tuesday", "a documentary about whales",
                 "the best kind of sandwich", "an old video game", "the history of the bicycle", "my neighbour's cat",
                 "a song I heard on the radio", "the price of coffee", "a dream I had last night"]
RAMBLES = ["That reminds me of {t}. It was quite something, and I think about it a lot.",
           "Before that, let me tell you about {t}. Honestly it is much more interesting.",
           "Hmm. Have you ever thought about {t}? I was just thinking about it.",
           "Funny you ask. I was reading about {t} this morning, and it went on for hours.",
           "Let's talk about {t} instead. There is so much to say about it."]


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _capital(rng):
    (country, capital), wrong = rng.choice(CAPITALS), rng.choice(CAPITALS)[1]
    q = rng.choice(["What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital city of "
                    "{c}.", "Tell me the capital of {c}."]).format(c=country)
    say = "The capital of {c} is {x}.".format
    return q, say(c=country, x=capital), say(c=country, x=wrong) if wrong != capital else None, capital


def _arithmetic(rng):
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    off = rng.choice([-10, -3, -2, -1, 1, 2, 3, 10])
    if rng.random() < 0.6:
        q = rng.choice(["What is {a} plus {b}?", "What is {a} + {b}?", "Add {a} and {b}.",
                        "What do you get when you add {a} and {b}?"]).format(a=a, b=b)
        return q, f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {a + b + off}.", str(a + b)
    a, b = max(a, b), min(a, b)
    q = rng.choice(["What is {a} minus {b}?", "What is {a} - {b}?", "Subtract {b} from {a}."]).format(a=a, b=b)
    return q, f"{a} minus {b} is {a - b}.", f"{a} minus {b} is {a - b + off}.", str(a - b)


def _opposite(rng):
    (w, o), wrong = rng.choice(OPPOSITES), rng.choice(OPPOSITES)[1]
    q = rng.choice(["What is the opposite of {w}?", "Give me the opposite of the word {w}.",
                    "What word means the opposite of {w}?"]).format(w=w)
    return q, f"The opposite of {w} is {o}.", f"The opposite of {w} is {wrong}." if wrong != o else None, o


def _plural(rng):
    w, right, wrong = rng.choice(PLURALS)
    q = rng.choice(["What is the plural of {w}?", "How do you say more than one {w}?",
                    "What is the plural form of the word {w}?"]).format(w=w)
    return q, f"The plural of {w} is {right}.", f"The plural of {w} is {wrong}.", right


def _legs(rng):
    (animal, n), wrong = rng.choice(LEGS), rng.choice([2, 4, 6, 8, 10])
    q = rng.choice(["How many legs does {a} have?", "How many legs has {a} got?",
                    "Count the legs of {a}."]).format(a=_a(animal))
    say = f"{_a(animal).capitalize()} has {{}} legs.".format
    return q, say(n), say(wrong) if wrong != n else None, str(n)


def _next_in_order(rng):
    names, what = (DAYS, "day") if rng.random() < 0.45 else (MONTHS, "month")
    i = rng.randrange(len(names))
    right, wrong = names[(i + 1) % len(names)], names[(i + rng.choice([2, 3, -1])) % len(names)]
    q = rng.choice(["What {w} comes after {x}?", "Which {w} follows {x}?", "What is the {w} after {x}?"]).format(
        w=what, x=names[i])
    return q, f"The {what} after {names[i]} is {right}.", f"The {what} after {names[i]} is {wrong}.", right


def _colour(rng):
    thing, colour = rng.choice(COLOURS)
    wrong = rng.choice([c for c in COLOUR_NAMES if c != colour])
    q = rng.choice(["What colour is {t}?", "What color is {t}?", "Which colour is {t} usually?"]).format(t=thing)
    cap = thing[0].upper() + thing[1:]
    return q, f"{cap} is {colour}.", f"{cap} is {wrong}.", colour


def _units(rng):
    small, one, many, k = rng.choice(UNITS)
    n = rng.randint(2, 12)
    q = rng.choice(["How many {s} are in {n} {m}?", "How many {s} are there in {n} {m}?",
                    "Convert {n} {m} to {s}."]).format(s=small, n=n, m=many)
    wrong = f"{n} {many} is {n * k + rng.choice([-k, k, 10, -10])} {small}."
    return q, f"{n} {many} is {n * k} {small}.", wrong, str(n * k)


def _tip(rng):
    noun, verb, answer = rng.choice(TIPS)
    q = rng.choice(["Give me one tip for {n}.", "How can I {v}?", "Any advice on {n}?",
                    "What is a good way to {v}?"]).format(n=noun, v=verb)
    return q, answer, None, None


def _definition(rng):
    thing, answer = rng.choice(DEFINITIONS)
    q = rng.choice(["What is {t}?", "Explain what {t} is in one sentence.", "Define {t}.",
                    "In simple words, what is {t}?"]).format(t=thing)
    return q, answer, None, None


FAMILIES = [_capital, _arithmetic, _opposite, _plural, _legs, _next_in_order, _colour, _units, _tip, _definition]


def chat_rows(n: int = DEFAULT_ROWS, seed: int = 0, skip: set[str] | frozenset = frozenset()) -> list[dict]:
    """n conversational rows, each prompt a distinct text (module doc); the same n and seed give the same rows.
    skip: prompt texts left out (fresh held-out rows for a training set's prompts)."""
    return [row for row, _ in rows_and_facts(n, seed, skip)]


def rows_and_facts(n: int = DEFAULT_ROWS, seed: int = 0, skip: set[str] | frozenset = frozenset()
                   ) -> list[tuple[dict, str | None]]:
    """chat_rows' rows, each with the fact a right answer states (the capital, the sum, the plural, ...: the word
    or number its chosen answer has and its wrong-fact answer lacks); None for tips and definitions."""
    rng = random.Random(seed)
    rows, seen, tries = [], set(skip), 0
    while len(rows) < n:
        family = FAMILIES[len(rows) % len(FAMILIES)]  # round robin: every family in every tenth of the rows
        question, answer, wrong, fact = family(rng)
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"{n} rows: more than the families' distinct prompts (about 500 at 50 per family)")
        if question in seen:
            continue
        seen.add(question)
        # a wrong fact for half of the fact rows; the others, and tips and definitions, a refusal or a ramble
        kind = "wrong" if wrong is not None and rng.random() < 0.5 else rng.choice(["refusal", "ramble"])
        rejected = {"wrong": lambda: wrong, "refusal": lambda: rng.choice(REFUSALS),
                    "ramble": lambda: rng.choice(RAMBLES).format(t=rng.choice(RAMBLE_TOPICS))}[kind]()
        rows.append(({"prompt": [{"role": "user", "content": question}],
                      "chosen": [{"role": "assistant", "content": answer}],
                      "rejected": [{"role": "assistant", "content": rejected}]}, fact))
    return rows


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def states(answer: str, fact: str) -> bool:
    """Whether an answer states the fact: the word or number as a whole word, any case (a number also as 1,000
    or, up to twenty, as its word). It may state other things too: a right fact beside a wrong one counts."""
    forms = {fact}
    if fact.lstrip("-").isdigit():
        forms.add(f"{int(fact):,}")
        if 0 <= int(fact) < len(NUMBER_WORDS):
            forms.add(NUMBER_WORDS[int(fact)])
    return any(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w]|,\d)", answer, re.I) for f in forms)


def write(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=str(DEFAULT_PATH))
    ap.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = write(chat_rows(args.rows, args.seed), args.out)
    print(f"wrote {args.rows} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
