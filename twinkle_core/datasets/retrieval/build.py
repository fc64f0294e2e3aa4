"""Builds the bundled retrieval set (train.jsonl, heldout.jsonl) from a fixed seed, byte for byte.

    python -m twinkle_core.datasets.retrieval.build
    python twinkle_core/datasets/retrieval/build.py

Every entity is invented (towns, companies, species, people with made-up names), so no pretrained model
can know the facts. Each (entity, attribute) pair gives one passage (one or two sentences, one of several
templates) and one query that asks for the attribute indirectly (one of several templates, not copying the
passage's wording). Hard negatives are passages about other attributes of the same entity (1-2 per row),
sometimes plus the same attribute of another entity of the same kind. Train and heldout use disjoint
entities and names, the same attributes and templates. Standard library only.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240611
HERE = Path(__file__).resolve().parent
ENTITIES_PER_KIND = {"train": 15, "heldout": 9}  # 4 kinds x 6 attributes -> 360 and 216 rows

# --------------------------------------------------------------------------------------------- names
ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "sk", "t",
          "th", "tr", "v", "vr", "z", "zh", "y", "h", "ost", "el", "ar", "is"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "y"]
CODAS = ["", "", "l", "n", "r", "s", "th", "v", "m", "x", "nd", "rk", "sh"]
ENDINGS = ["a", "ora", "ith", "enne", "ar", "ost", "ev", "ul", "ine", "aro", "esk", "wyn", "ada", "im", "orn"]


def make_name(rng: random.Random, syllables: int, used: set[str]) -> str:
    """An invented word of `syllables` syllables (the last one an ending), unused so far."""
    assert syllables >= 2
    while True:
        # a name is (syllables - 1) onset-vowel-coda groups and an ending; at least one group, or it is too short
        groups = max(1, syllables - 1)
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(groups))
        word = (word + rng.choice(ENDINGS)).capitalize()
        if 5 <= len(word) <= 10 and word not in used:
            used.add(word)
            return word


# ----------------------------------------------------------------------------------------- value pools
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
COLORS = ["crimson", "turquoise", "ochre", "violet", "emerald", "amber", "cobalt blue", "rose pink", "slate grey",
          "saffron", "teal", "scarlet", "olive green", "ivory white", "copper orange"]
FESTIVAL_THINGS = [("lantern", "lanterns"), ("kite", "kites"), ("bonfire", "bonfires"), ("mask", "masks"),
                   ("honey", "honey cakes"), ("boat", "decorated boats"), ("drum", "drums"), ("flower", "flowers"),
                   ("candle", "candles"), ("cheese", "cheese wheels"), ("puppet", "puppets"), ("apple", "apples")]
TOWN_GOODS = ["copper kettles", "woollen blankets", "glass beads", "smoked fish", "clay roof tiles", "pear cider",
              "leather saddles", "wooden clocks", "goat cheese", "linen sails", "silver buttons", "beeswax candles",
              "hand-woven rugs", "pickled cabbage", "iron nails"]
COMPANY_SUFFIXES = ["Works", "Instruments", "Foods", "Textiles", "Robotics", "Shipping", "Optics", "Labs",
                    "Ceramics", "Motors"]
COMPANY_PRODUCTS = ["folding bicycles", "solar kettles", "noise-cancelling earmuffs", "self-watering plant pots",
                    "waterproof notebooks", "electric scooters", "pocket telescopes", "frozen dumplings",
                    "ceramic water filters", "wind-up radios", "hiking boots", "smart door locks",
                    "children's puzzle games", "garden drones", "insulated lunch boxes"]
ANIMAL_KINDS = ["newt", "moth", "finch", "lizard", "beetle", "frog", "shrew", "heron", "snail", "bat", "eel", "toad"]
HABITATS = ["mossy cloud forests", "salt marshes", "high alpine meadows", "limestone caves", "mangrove swamps",
            "dry thorn scrub", "cold mountain streams", "sand dunes", "bamboo thickets", "peat bogs", "coral lagoons",
            "volcanic slopes"]
DIETS = ["fallen figs", "mosquito larvae", "lichens", "tiny freshwater shrimp", "pine seeds", "nectar from night "
         "flowers", "snails", "ant eggs", "water beetles", "ripe berries", "mushrooms", "grass seeds"]
SOUNDS = ["soft clicking", "high whistling", "low humming", "sharp chirping", "bubbling", "rattling",
          "flute-like", "deep booming"]
INVENTIONS = ["a pedal-powered washing machine", "a folding umbrella for bicycles", "a clock that runs on rainwater",
              "a glass harmonica with foot pedals", "a self-heating bread oven", "a lamp fuelled by walnut oil",
              "a mechanical tea stirrer", "a snow-melting street lamp", "a reading stand that turns pages",
              "a wind-powered butter churn", "an underwater signal bell", "a silent sewing machine",
              "a portable hay press", "a spring-loaded mousetrap", "a candle clock with alarms",
              "a pocket sundial with a compass", "a rope ladder for firefighters", "a steam-driven egg beater"]
INSTRUMENTS = ["cello", "harp", "accordion", "oboe", "violin", "bagpipes", "trumpet", "flute", "banjo",
               "double bass", "harpsichord", "clarinet"]
FIRST_NAMES = ["Ilsa", "Oren", "Maelis", "Tovan", "Brisa", "Corvin", "Elke", "Jory", "Neris", "Quill", "Saffa",
               "Teodor", "Wren", "Yanek", "Adela", "Bastien", "Liora", "Pim", "Rosalind", "Ulric", "Vesna", "Hollis",
               "Marit", "Desmond"]

# ------------------------------------------------------------------ templates: (passages, queries) per attribute
# {e}: the entity, {v}/{w}: values. Queries never name the value and avoid the passages' key words.
TEMPLATES: dict[str, dict[str, tuple[list[str], list[str]]]] = {
    "town": {
        "founded": (["{e} was founded in {v} by a small group of salt traders.",
                     "The first stone houses of {e} were built in {v}.",
                     "{e} received its town charter in the year {v}, after decades as a hamlet.",
                     "Records show that settlers arrived at the site of {e} in {v}."],
                    ["How old is {e}?", "Since when have people lived in {e}?",
                     "In which century did {e} come into existence?", "How far back does the history of {e} go?",
                     "When did {e} get its start?"]),
        "river": (["{e} sits on the banks of the {v} river.",
                   "Barges on the {v} stop at the old docks of {e}.",
                   "The {v} flows right through the centre of {e}, under seven bridges.",
                   "Fishermen in {e} cast their nets into the {v} every morning."],
                  ["What waterway passes by {e}?", "Which stream was {e} built beside?",
                   "What current of water runs past the houses of {e}?",
                   "Where would a boat heading to {e} travel?", "Which body of fresh water is {e} next to?"]),
        "festival": (["{e}'s annual {v} festival is held every {w}.",
                      "Every {w}, the streets of {e} fill with {x} for a week of celebration.",
                      "The biggest event of the year in {e} is the {v} fair, which takes place in {w}."],
                     ["When do people in {e} throw their big yearly party?",
                      "Which month is the most festive in {e}?", "What do the locals of {e} celebrate, and when?",
                      "When is the best time to visit {e} for the festivities?",
                      "What is the traditional holiday of {e}?"]),
        "industry": (["{e} is known across the region for making {v}.",
                      "Most families in {e} earn their living by producing {v}.",
                      "The workshops of {e} have turned out {v} for generations."],
                     ["What do people in {e} do for work?", "How does {e} make its money?",
                      "What souvenir would you bring home from {e}?",
                      "Which trade keeps the economy of {e} going?", "What is {e}'s chief export?"]),
        "mayor": (["The current mayor of {e} is {v}.",
                   "{v} has led the town council of {e} since {w}.",
                   "Residents of {e} elected {v} to run the town hall."],
                  ["Who is in charge of {e}?", "Who heads the local government of {e}?",
                   "Whose signature is on the official decisions in {e}?", "Who governs {e} today?",
                   "Who would you petition to change a rule in {e}?"]),
        "color": (["Nearly every roof in {e} is painted {v}.",
                   "The houses of {e} are famous for their {v} walls.",
                   "Visitors to {e} remember its {v} doors and shutters."],
                  ["What does {e} look like from a distance?", "What shade dominates the buildings of {e}?",
                   "Which hue would you see on the homes of {e}?", "How would you recognise {e} in a photograph?",
                   "What tint are the dwellings of {e}?"]),
    },
    "company": {
        "founded": (["{e} was established in {v}.",
                     "{e} opened its first office in {v}.",
                     "{e} has been in operation since {v}, when it began with three employees."],
                    ["How long has {e} been in business?", "When did {e} start trading?",
                     "How old is the firm {e}?", "In which year did {e} get going?",
                     "Since when has {e} existed?"]),
        "founder": (["{e} was started by the engineer {v}.",
                     "{v} set up {e} in a rented garage.",
                     "The firm {e} owes its existence to {v}, who wrote its first business plan."],
                    ["Who is behind the creation of {e}?", "Whose idea was {e}?",
                     "Who got {e} off the ground?", "Which person launched {e}?",
                     "Who should be credited with starting {e}?"]),
        "headquarters": (["{e} has its headquarters in the city of {v}.",
                          "The main offices of {e} are located in {v}.",
                          "Most of the staff of {e} work at its head office in {v}."],
                         ["Where is {e} based?", "In which town would you find the leadership of {e}?",
                          "Where should a letter to the management of {e} be sent?",
                          "Which place does {e} call home?", "Where is the central base of {e}?"]),
        "product": (["{e} is best known for its {v}.",
                     "The bestselling item from {e} is a line of {v}.",
                     "Shops stock {v} made by {e} more than any other brand."],
                    ["What does {e} sell?", "What would a customer of {e} typically buy?",
                     "What is the flagship offering of {e}?", "What goods does {e} put on the market?",
                     "What is {e} famous for manufacturing?"]),
        "employees": (["{e} employs about {v} people.",
                       "Around {v} workers are on the payroll of {e}.",
                       "{e} has grown to a staff of roughly {v}."],
                      ["How big is the workforce of {e}?", "How many individuals work for {e}?",
                       "What is the size of the team at {e}?", "How large an employer is {e}?",
                       "How many jobs does {e} provide?"]),
        "color": (["The logo of {e} is a {v} circle.",
                   "{e} paints all of its delivery vans {v}.",
                   "Staff at {e} wear {v} uniforms, the company colour."],
                  ["How would you recognise the trucks of {e}?", "What shade is the branding of {e}?",
                   "Which hue represents {e}?", "What does the emblem of {e} look like?",
                   "What tint stands out on the packaging of {e}?"]),
    },
    "species": {
        "habitat": (["The {e} lives in the {v}.",
                     "Biologists have only ever found the {e} in {v}.",
                     "The {v} are the natural home of the {e}."],
                    ["Where can you find the {e} in the wild?", "What is the home range of the {e}?",
                     "Where should you search to spot a {e}?", "In which kind of landscape does the {e} dwell?",
                     "Where is the {e} native to?"]),
        "diet": (["The {e} feeds mainly on {v}.",
                  "{v_cap} make up most of what the {e} eats.",
                  "At night the {e} forages for {v}."],
                 ["What is the favourite meal of the {e}?", "What does the {e} need to survive on?",
                  "What food would you leave out to attract a {e}?", "What does the {e} hunt or graze on?",
                  "How does the {e} get its nourishment?"]),
        "color": (["The {e} has {v} markings along its back.",
                   "Adult specimens of the {e} are a bright {v}.",
                   "The {e} is easy to spot thanks to its {v} patches."],
                  ["How can you tell the {e} apart by its appearance?", "What does the {e} look like?",
                   "Which shade is the body of the {e}?", "How would you describe the pattern of the {e}?",
                   "What hue is the {e}'s skin or plumage?"]),
        "lifespan": (["The {e} usually lives for about {v} years.",
                      "A healthy {e} can reach an age of {v} years.",
                      "Few {e}s survive beyond {v} years in the wild."],
                     ["How long does the {e} survive?", "What is the life expectancy of the {e}?",
                      "How many birthdays can a {e} expect?", "How old can a {e} get?",
                      "When does a {e} typically die of natural causes?"]),
        "discoverer": (["The {e} was first described by the naturalist {v} in {w}.",
                        "{v} collected the first specimen of the {e} in {w}.",
                        "Zoologists learned of the {e} from the field notes of {v}."],
                       ["Who identified the {e} for science?", "Who recorded the {e} before anyone else?",
                        "Which explorer brought the {e} to the attention of researchers?",
                        "Who is credited with finding the {e}?", "Who first catalogued the {e}?"]),
        "sound": (["The {e} makes a {v} sound at dusk.",
                   "On warm evenings you can hear the {v} call of the {e}.",
                   "The {e} announces itself with a {v} noise."],
                  ["What noise does the {e} produce?", "How would you know a {e} is nearby without seeing it?",
                   "What would a recording of the {e} capture?", "How does the {e} communicate?",
                   "What would reach your ears from a {e} at nightfall?"]),
    },
    "person": {
        "birthplace": (["{e} was born in the village of {v}.",
                        "{e} spent a childhood in {v}, a village by the sea.",
                        "The village of {v} proudly calls {e} its most famous child."],
                       ["Where did {e} grow up?", "What is the hometown of {e}?",
                        "Which place can count {e} as a local?", "Where does {e} come from?",
                        "In what place did {e} spend the early years?"]),
        "invention": (["{e} invented {v}.",
                       "{e} is remembered as the creator of {v}.",
                       "The patent for {v} was filed by {e}."],
                      ["What device is {e} famous for?", "What did {e} bring into the world?",
                       "Which machine do we owe to {e}?", "What was the great contribution of {e} to technology?",
                       "What gadget came from the mind of {e}?"]),
        "birthyear": (["{e} was born in {v}.",
                       "{e} came into the world in the year {v}.",
                       "{v} was the year of {e}'s birth."],
                      ["How long ago did {e} live?", "In what era was {e} alive?", "How old would {e} be today?",
                       "When does the life story of {e} begin?", "Which generation did {e} belong to?"]),
        "instrument": (["In spare hours {e} played the {v}.",
                        "{e} was a skilled {v} player.",
                        "Friends remember {e} practising the {v} every evening."],
                       ["What music did {e} make?", "What did {e} do for fun?",
                        "Which hobby filled the free time of {e}?", "What could {e} perform at a concert?",
                        "What was {e} like outside of work?"]),
        "employer": (["{e} worked for many years at {v}.",
                      "{e} spent an entire career on the staff of {v}.",
                      "{v} hired {e} as a young apprentice."],
                     ["Where was {e} employed?", "Who paid the salary of {e}?",
                      "Which firm did {e} serve?", "What was the workplace of {e}?",
                      "Which organisation did {e} devote a working life to?"]),
        "award": (["{e} received the {v} Medal in {w}.",
                   "In {w}, {e} was honoured with the {v} Prize.",
                   "The {v} Award went to {e} in {w}."],
                  ["What honour was given to {e}?", "How was the work of {e} recognised?",
                   "What distinction did {e} earn?", "Which trophy sits on the shelf of {e}?",
                   "Did {e} ever win anything?"]),
    },
}


# ------------------------------------------------------------------------------------------ generation
def person_name(rng: random.Random, used: set[str]) -> str:
    return f"{rng.choice(FIRST_NAMES)} {make_name(rng, 2, used)}"


def make_entity(kind: str, rng: random.Random, used: set[str]) -> dict:
    """One invented entity: its name and a value (or values) for each attribute of its kind."""
    year = lambda lo, hi: str(rng.randint(lo, hi))  # noqa: E731
    if kind == "town":
        thing = rng.choice(FESTIVAL_THINGS)
        return {"name": make_name(rng, 2, used), "founded": {"v": year(1150, 1890)},
                "river": {"v": make_name(rng, 2, used)},
                "festival": {"v": thing[0], "w": rng.choice(MONTHS), "x": thing[1]},
                "industry": {"v": rng.choice(TOWN_GOODS)},
                "mayor": {"v": person_name(rng, used), "w": year(1995, 2022)},
                "color": {"v": rng.choice(COLORS)}}
    if kind == "company":
        return {"name": f"{make_name(rng, 2, used)} {rng.choice(COMPANY_SUFFIXES)}",
                "founded": {"v": year(1890, 2015)}, "founder": {"v": person_name(rng, used)},
                "headquarters": {"v": make_name(rng, 2, used)}, "product": {"v": rng.choice(COMPANY_PRODUCTS)},
                "employees": {"v": f"{rng.randint(2, 95) * 100:,}"}, "color": {"v": rng.choice(COLORS)}}
    if kind == "species":
        diet = rng.choice(DIETS)
        return {"name": f"{make_name(rng, 2, used)} {rng.choice(ANIMAL_KINDS)}",
                "habitat": {"v": rng.choice(HABITATS)}, "diet": {"v": diet, "v_cap": diet[0].upper() + diet[1:]},
                "color": {"v": rng.choice(COLORS)}, "lifespan": {"v": str(rng.randint(2, 40))},
                "discoverer": {"v": person_name(rng, used), "w": year(1760, 1990)},
                "sound": {"v": rng.choice(SOUNDS)}}
    if kind == "person":
        return {"name": person_name(rng, used), "birthplace": {"v": make_name(rng, 2, used)},
                "invention": {"v": rng.choice(INVENTIONS)}, "birthyear": {"v": year(1790, 1960)},
                "instrument": {"v": rng.choice(INSTRUMENTS)},
                "employer": {"v": f"{make_name(rng, 2, used)} {rng.choice(COMPANY_SUFFIXES)}"},
                "award": {"v": make_name(rng, 2, used), "w": year(1850, 2020)}}
    raise ValueError(kind)


def fill(template: str, entity: str, values: dict[str, str]) -> str:
    text = template.format(e=entity, **{k: values.get(k, "") for k in ("v", "w", "x", "v_cap")})
    return text[0].upper() + text[1:]


def build_split(split: str, rng: random.Random, used: set[str]) -> list[dict]:
    rows = []
    for kind, attributes in TEMPLATES.items():
        entities = [make_entity(kind, rng, used) for _ in range(ENTITIES_PER_KIND[split])]
        passages = [{attr: fill(rng.choice(pair[0]), ent["name"], ent[attr]) for attr, pair in attributes.items()}
                    for ent in entities]
        for i, ent in enumerate(entities):
            for attr, (_, queries) in attributes.items():
                positive = passages[i][attr]
                others = [a for a in attributes if a != attr]
                negatives = [passages[i][a] for a in rng.sample(others, rng.choice((1, 2)))]
                if rng.random() < 0.5:  # the same attribute of another entity of the same kind
                    negatives.append(passages[rng.choice([j for j in range(len(entities)) if j != i])][attr])
                rows.append({"query": fill(rng.choice(queries), ent["name"], {}), "positive": positive,
                             "negatives": negatives})
    rng.shuffle(rows)
    return rows


def check(rows: list[dict]) -> None:
    queries = [row["query"] for row in rows]
    assert len(set(queries)) == len(queries), "duplicate query"
    for row in rows:
        assert row["positive"] not in row["negatives"] and len(set(row["negatives"])) == len(row["negatives"])
        assert len(row["query"].split()) < 20, row["query"]
        for text in [row["positive"], *row["negatives"]]:
            assert len(text.split()) < 40 and "{" not in text, text


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    used: set[str] = set()  # every invented name, across both splits: heldout shares no name with train
    splits = {split: build_split(split, rng, used) for split in ENTITIES_PER_KIND}
    for rows in splits.values():
        check(rows)
    return splits


def main() -> None:
    for split, rows in build().items():
        with open(HERE / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        corpus = {text for row in rows for text in [row["positive"], *row["negatives"]]}
        print(f"{split}.jsonl: {len(rows)} rows, {len(corpus)} distinct passages")


if __name__ == "__main__":
    main()
