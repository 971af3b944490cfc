"""Training the target and draft models with optax."""

from jaxspec.training.train import evaluate, init_params, lm_loss, make_optimizer, train

__all__ = ['evaluate', 'init_params', 'lm_loss', 'make_optimizer', 'train']
