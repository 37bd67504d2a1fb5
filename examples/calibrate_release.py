"""Choose StepTrim release settings on validation data, then serve with them.

    python examples/calibrate_release.py [--examples 60]

Uses the shipped testbed's science adapter (four-option questions answered with a short
explanation): a profiled release length k and a learned risk head, each picked to skip at least
half of the decode LoRA calls, compared on the same validation prompts.
"""

import argparse
import tempfile

from lorazor import LoRazorConfig, LoRazorModel
from lorazor.calibration import ValidationSet, calibrate_learned, calibrate_profiled
from lorazor.testbed import load

parser = argparse.ArgumentParser()
parser.add_argument("--examples", type=int, default=60, help="training and validation prompts (fewer: faster)")
n = parser.parse_args().examples
peft_model, tokenizer, tasks = load()
model = LoRazorModel.from_peft(peft_model, LoRazorConfig())
task = tasks["science"]
generation = dict(max_new_tokens=task.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)


def task_set(split, n):
    examples = task.split(split)[:n]
    # score(answer, i): the task's evaluator against example i.
    return ValidationSet(
        [ex["prompt"] for ex in examples], lambda answer, i: task.score(answer, examples[i]), generation
    )


validation = {"science": task_set("validation", n)}
profiled, profiled_curves = calibrate_profiled(model, tokenizer, validation, min_skip=0.5, lengths=(0, 1, 2, 4, 8, 16),
                                               progress=True)
learned, learned_curves = calibrate_learned(
    model, tokenizer, {"science": task_set("train", n)}, validation, min_skip=0.5, progress=True
)

full = profiled_curves["science"][0]
k = profiled.lengths["science"]
chosen_k = next(p for p in profiled_curves["science"] if p.k == k)
tau = learned.heads["science"][2]
chosen_tau = next(p for p in learned_curves["science"] if p.tau == tau)
print(f"full LoRA:          accuracy {full.accuracy:.1%}")
print(f"profiled k={k}:       accuracy {chosen_k.accuracy:.1%}, decode LoRA skipped {chosen_k.skip_fraction:.0%}")
print(f"learned tau={tau:.2f}: accuracy {chosen_tau.accuracy:.1%}, decode LoRA skipped {chosen_tau.skip_fraction:.0%}")

# Save beside the adapters and serve with it as the default policy.
from lorazor import save_release_policy  # noqa: E402

with tempfile.TemporaryDirectory() as folder:
    save_release_policy(learned, folder)
    served = LoRazorModel.from_peft(load()[0], LoRazorConfig(release="learned"))
    served.load_release_policy(folder)
    enc = tokenizer([validation["science"].prompts[0]], return_tensors="pt", padding=True)
    out = served.generate(enc["input_ids"], attention_mask=enc["attention_mask"], adapter_ids=["science"], **generation)
    print("served:", repr(tokenizer.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)),
          "release step", int(out.release_steps[0]))
