"""transformers' `generate` under `python -m tidepool.plan run`: greedy
search and sampling (`GenerationMixin._sample`) generate to their length
limit (`max_new_tokens`, `max_length`), as when no sequence ends before
it: the longest generation, whose KV cache is the largest.

Why: the decoding loop stops when every sequence has finished, which it
reads from the card (`unfinished_sequences.max() == 0`, in its
`StopCheck`); the placeholder for that read is True, so it would stop
after the first token. Here the stop test is answered by the length
alone; the read still happens, and the report lists it. Beam search and
assisted decoding keep their own loops, and their placeholders.
"""
import contextlib
import importlib.util

from .patching import replaced


@contextlib.contextmanager
def generating_to_the_limit():
    """While inside: `_sample`'s stop test is `length >= max_length`."""
    if importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers.generation import utils

    mixin, check = utils.GenerationMixin, getattr(utils, "StopCheck", None)
    if check is None or not hasattr(mixin, "_sample"):  # another transformers: its loop as it is
        yield
        return
    limits = []  # the length limit of each `_sample` running, innermost last
    sample, stop = mixin._sample, check.__call__

    def _sample(self, input_ids, logits_processor, stopping_criteria, *args, **kwargs):
        limits.append(getattr(stopping_criteria, "max_length", None))
        try:
            return sample(self, input_ids, logits_processor, stopping_criteria, *args, **kwargs)
        finally:
            limits.pop()

    def stop_at_the_limit(self, unfinished_sequences, tokens, length):
        said = stop(self, unfinished_sequences, tokens, length)
        return said if not limits or limits[-1] is None else length >= limits[-1]

    with replaced((mixin, "_sample", _sample), (check, "__call__", stop_at_the_limit)):
        yield
