"""GSM8K for lowwater (see the distribution's README)."""

from lowwater_gsm8k.env import GSM8KEnvironment, read_tasks

__all__ = ["GSM8KEnvironment", "read_tasks"]
