"""Training the target and draft models with optax."""

from jaxspec.training.train import (check_settings, evaluate, init_params, lm_loss, make_optimizer,
                                    train)

__all__ = ['check_settings', 'evaluate', 'init_params', 'lm_loss', 'make_optimizer', 'train']
