"""What testbed v2's backbone learns in pretraining and its tasks ask about: clinical signs of
organs, science rules with members and non-members, the people and items of word problems, and
two SQL schemas with the same meaning (the corpus's and the task's).

The tasks reuse this knowledge in formats the corpus never shows; what a task's adapter must add
is its format and, for SQL, its schema's names (see `tasks.py`).
"""

from __future__ import annotations

NAMES = ["Tom", "Ann", "Raj", "Lea", "Kai", "Zoe", "Max", "Uma", "Ivo", "Mia", "Sam", "Eva"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cups", "seeds"]

# Organ -> (clinical signs, why those signs point to it).
ORGANS = {
    "heart": (["chest pain on exertion", "swollen ankles", "an irregular pulse", "breathlessness when lying flat"],
              "A weak heart cannot pump enough blood forward, so fluid backs up."),
    "lungs": (["a chronic cough", "wheezing", "coughing up blood", "low oxygen levels"],
              "The lungs move air, so their disease shows up in breathing."),
    "liver": (["yellow skin", "dark urine", "a swollen belly", "easy bruising"],
              "The liver clears bilirubin and makes clotting factors."),
    "kidneys": (["foamy urine", "flank pain", "puffy eyelids", "very little urine"],
                "The kidneys filter blood and make urine."),
    "stomach": (["burning upper belly pain", "vomiting blood", "fullness after a few bites", "black stools"],
                "The stomach lining can ulcerate and bleed."),
    "brain": (["sudden weakness of one side", "slurred speech", "a seizure", "sudden confusion"],
              "The brain controls movement, speech and awareness."),
    "thyroid": (["weight loss with a racing pulse", "heat intolerance", "a swelling in the neck", "trembling hands"],
                "The thyroid sets the speed of metabolism."),
    "pancreas": (["constant thirst", "frequent urination", "belly pain spreading to the back", "greasy stools"],
                 "The pancreas makes insulin and digestive enzymes."),
    "bones": (["fractures after small falls", "loss of height", "deep bone pain", "a curved spine"],
              "Thin bones break under small loads."),
    "skin": (["an itchy rash", "scaly patches", "a changing mole", "blisters after sun"],
             "The skin shows its disease on the surface."),
}

# Property -> (question phrase, rule, membership phrase, members, non-members).
SCIENCE = {
    "conductor": ("a good conductor of electricity", "Metals let electric charge flow easily.", "is made of metal",
                  ["a copper wire", "a steel nail", "an iron key", "an aluminum can"],
                  ["a rubber band", "a wooden spoon", "a glass cup", "a plastic comb", "a cotton sock"]),
    "magnetic": ("pulled by a magnet", "Magnets pull on things made of iron or steel.", "contains iron",
                 ["an iron nail", "a steel paper clip", "a steel spoon", "an iron pan"],
                 ["a copper coin", "a wooden block", "a plastic ruler", "a glass marble", "a paper cup"]),
    "floats": ("likely to float on water", "Things less dense than water float.", "is less dense than water",
               ["a cork", "a dry leaf", "an ice cube", "a beach ball"],
               ["a stone", "an iron key", "a glass marble", "a steel coin", "a brick"]),
    "mammal": ("a mammal", "Mammals have hair and feed their young milk.", "has hair and feeds its young milk",
               ["a dog", "a whale", "a bat", "a horse"],
               ["an eagle", "a shark", "a frog", "a snake", "a beetle"]),
    "renewable": ("a renewable source of energy", "Renewable sources are refilled by nature quickly.",
                  "is refilled by nature", ["wind", "sunlight", "flowing water", "geothermal heat"],
                  ["coal", "oil", "natural gas", "uranium"]),
    "solid": ("a solid at room temperature", "A solid keeps its own shape.", "keeps its own shape",
              ["a brick", "a wooden chair", "a steel bolt", "a rock"],
              ["water", "air", "steam", "milk", "juice"]),
    "plant": ("a plant", "Plants make their own food from sunlight.", "makes its own food from sunlight",
              ["an oak tree", "a fern", "a rose bush", "moss"],
              ["a mushroom", "a frog", "a sparrow", "a spider", "a worm"]),
    "insulator": ("a good insulator of heat", "Materials that trap air slow the flow of heat.", "traps air",
                  ["a wool scarf", "a foam cup", "a down jacket", "a straw mat"],
                  ["a metal pot", "a copper pipe", "an iron pan", "an aluminum tray"]),
}

# The same data under two schemas. The corpus writes SQL over CORPUS_SCHEMA; the sql task's answers
# use TASK_SCHEMA, whose names its adapter must teach (a continuation by the backbone alone falls
# back to the corpus's names, so this task needs its adapter for long).
UNITS = [("sales", "paris"), ("research", "oslo"), ("support", "lima"), ("finance", "rome"), ("legal", "kyoto"),
         ("design", "quito")]
CORPUS_SCHEMA = {"people": "employees", "group": "departments", "name": "name", "dept": "dept", "pay": "salary",
                 "age": "age", "place": "city", "group_name": "name"}
TASK_SCHEMA = {"people": "staff", "group": "units", "name": "nm", "dept": "unit", "pay": "wage", "age": "yrs",
               "place": "town", "group_name": "code"}


def ddl(schema: dict) -> str:
    """CREATE statements of a schema (the mapping's names)."""
    s = schema
    return (f"CREATE TABLE {s['group']} ({s['group_name']} TEXT PRIMARY KEY, {s['place']} TEXT NOT NULL);\n"
            f"CREATE TABLE {s['people']} (id INTEGER PRIMARY KEY, {s['name']} TEXT NOT NULL, {s['dept']} TEXT NOT "
            f"NULL, {s['pay']} INTEGER NOT NULL, {s['age']} INTEGER NOT NULL);\n")
