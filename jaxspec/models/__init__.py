"""Llama-family decoder (Flax Linen), its config and presets, and checkpoints (ours and Hugging
Face's: `load_model` reads either layout)."""

from jaxspec.cache import init_cache

from jaxspec.models.checkpoint import (CheckpointError, check_params, load_model, param_shapes,
                                      save_model, shipped)
from jaxspec.models.config import PRESETS, ModelConfig
from jaxspec.models.hf import is_pretrained, load_pretrained, save_pretrained, truncate_vocab
from jaxspec.models.llama import Transformer, apply_rope, matmul_rows

__all__ = ['CheckpointError', 'check_params', 'load_model', 'param_shapes', 'save_model',
           'shipped', 'ModelConfig', 'PRESETS', 'Transformer', 'apply_rope', 'matmul_rows',
           'cache_for', 'is_pretrained', 'load_pretrained', 'save_pretrained', 'truncate_vocab']


def cache_for(config: ModelConfig, page_table, num_pages: int, page_size: int):
  """An empty `PagedKVCache` shaped for `config` (see `jaxspec.cache.init_cache`).

  Args:
    page_table: [B, pages_per_seq] int32; num_pages: pool size P (page 0 is the null page);
    page_size: L tokens per page.
  """
  return init_cache(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim, num_pages=num_pages, page_size=page_size,
                    page_table=page_table, dtype=config.dtype)
