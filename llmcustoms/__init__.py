"""llmcustoms: fine-tune a small open LLM on your own data with one command."""

__version__ = "0.1.0"
