"""Testbed v2 (in progress): four tasks with answers of tens of subword tokens, a corpus that
teaches their knowledge but not their formats, and a BPE tokenizer. Its backbone and adapters are
not trained or shipped yet; `lorazor.testbed` (v1) is the shipped testbed.

    from lorazor.testbed.v2 import make_tasks, pretraining_text, train_tokenizer
"""

from .corpus import pretraining_documents, pretraining_text
from .tasks import make_tasks
from .tokenizer import train_tokenizer

__all__ = ["make_tasks", "pretraining_documents", "pretraining_text", "train_tokenizer"]
