"""What the estimator refuses instead of guessing: an architecture (`UnsupportedArchitecture`,
re-exported by memfit.estimate.models.arch) and a model the tracer cannot trace (`TraceError`,
raised by memfit.estimate.trace)."""


class UnsupportedArchitecture(ValueError):
    """A config.json transformers itself cannot build as a causal LM (no model_type, a type
    outside AutoModelForCausalLM's mapping, an error from its constructor: the message names
    it), or a checkpoint whose weights disagree with its config.json. Refused, never guessed; the message names the
    file and the field. A ValueError, so the CLIs report it as bad input (exit 2)."""


class TraceError(ValueError):
    """The architecture cannot be traced (a missing field, a model transformers lacks)."""
