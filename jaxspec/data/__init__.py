"""Data: corpora of real files (stdlib code, botocore JSON), tokenizer, workloads, batches.

    from jaxspec.data import Tokenizer, documents, make_prompts, token_stream, random_windows
    from jaxspec.data import make_conversations, turn_prompt   # multi-turn agent loops
"""

from jaxspec.data.agent import Conversation, make_conversations, turn_prompt
from jaxspec.data.batches import random_windows, token_stream, train_mixture
from jaxspec.data.corpus import (Document, code_files, documents, json_files, read_text,
                                 split_of)
from jaxspec.data.tokenizer import Tokenizer
from jaxspec.data.workloads import WORKLOADS, Prompt, make_prompts

__all__ = ['Conversation', 'Document', 'Prompt', 'Tokenizer', 'WORKLOADS', 'code_files',
           'documents', 'json_files', 'make_conversations', 'make_prompts', 'random_windows',
           'read_text', 'split_of', 'token_stream', 'train_mixture', 'turn_prompt']
