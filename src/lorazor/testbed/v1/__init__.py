"""Testbed v1: the earlier character-level testbed (its tasks, corpus and tokenizer), kept to
rebuild its results (`python -m lorazor.testbed.train --version 1`). The shipped testbed is v2, in
`lorazor.testbed`."""
