"""memfit: fine-tune LLMs (SFT, DPO) on DeepSpeed without out-of-memory surprises.

Modules, each answering one question:
catalog (what hardware and models exist), estimate (how much memory and time a
config needs), space (which configs to consider), probe (what a config really
uses), select (which one to run), data, train, checkpoint, report.
"""

__version__ = "0.1.0"
