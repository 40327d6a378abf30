"""What `tidepool.plan` records: a model built from a MODEL spec on the meta
device, the batches it is fed, and the loss it is trained on.

MODEL is one of
- `hf:TYPE`: a transformers architecture by its model_type, with its
  default configuration and `--set key=value` overrides;
- a path to a `config.json` (a transformers configuration);
- `module:pkg.mod:factory`: a callable returning an `nn.Module` that maps
  token ids `(batch, seq)` to logits `(batch, seq, vocab)` (the causal-LM
  convention: the planner makes the ids and a cross-entropy loss), or a
  `Workload` for anything else; or a tuple `(model, optimizer)` of one of
  these and the optimizer training steps with (optimizer.py): a
  `torch.optim.Optimizer` over the model's parameters, or a callable making
  one from the parameters to train.

Configurations only: weights are never loaded and nothing is downloaded.
"""
import importlib
import json
import os
import sys

import torch

from .errors import FactoryError, PlanError  # (tidepool.workload.PlanError and FactoryError, as before)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class Workload:
    """A model and how to feed it, for models that are not token-id-to-logits.

    model: the nn.Module (built on the meta device: the factory runs under
        `torch.device("meta")`).
    make_batch(batch, seq): the inputs of one step, a dict of keyword
        arguments or a tuple of positional ones (tensors on "meta").
    loss(output, inputs): a scalar to call backward on; None: the output
        is the loss, or has a `.loss`.
    layers: the repeated blocks to checkpoint for --checkpointing (None:
        the largest nn.ModuleList in the model).
    """

    def __init__(self, model, make_batch, loss=None, layers=None):
        self.model, self.make_batch, self.loss_fn, self.layers = model, make_batch, loss, layers
        self.optimizer = None  # the factory's own, when it returns (model, optimizer)
        self.kind = "custom"
        # The model's context length when it says one (`context_length`),
        # which --seq defaults to; else 512.
        self.context = context_length(model)
        self.default_seq = self.context or 512
        self.vocab = None
        self.hf = False

    def inputs(self, batch, seq):
        return self.make_batch(batch, seq)

    def call(self, inputs, **extra):
        if isinstance(inputs, dict):
            return self.model(**inputs, **extra)
        return self.model(*inputs, **extra)

    def loss(self, output, inputs):
        if self.loss_fn is not None:
            return self.loss_fn(output, inputs)
        if isinstance(output, torch.Tensor):
            return output
        if getattr(output, "loss", None) is not None:
            return output.loss
        raise PlanError("the workload's model returns no loss: give Workload(loss=...)")


# Where a model or its configuration keeps its context length, by the
# names transformers, GPT-2's and nanoGPT's code and others use.
_CONTEXT_NAMES = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_seq_length", "block_size",
                  "context_length", "seq_len")


def context_length(model, config=None):
    """The context length `model` (or `config`) states, or None: a field of
    `_CONTEXT_NAMES` on the configuration, the model, or `model.config`."""
    for holder in (config, model, getattr(model, "config", None)):
        for name in _CONTEXT_NAMES:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _ids(batch, seq, vocab):
    return torch.randint(0, vocab, (batch, seq), device="meta")


class _TokensToLogits(Workload):
    """An nn.Module from token ids to logits, trained with cross-entropy."""

    def __init__(self, model, vocab):
        super().__init__(model, None)
        self.kind = "causal-lm"
        self.vocab = vocab

    def inputs(self, batch, seq):
        return (_ids(batch, seq, self.vocab or 2), _ids(batch, seq, self.vocab or 2))

    def call(self, inputs, **extra):
        return self.model(inputs[0])

    def loss(self, output, inputs):
        try:
            logits = output if isinstance(output, torch.Tensor) else output[0]
        except (TypeError, IndexError, KeyError):
            logits = output
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != inputs[1].shape:
            got = f"a tensor of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise PlanError(f"{type(self.model).__name__} returned {got} for token ids of shape "
                            f"{tuple(inputs[1].shape)}; expected logits (batch, seq, vocab), or return a "
                            "tidepool.workload.Workload with its own loss")
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), inputs[1].flatten())


class _HuggingFace(Workload):
    """A transformers model built from its configuration."""

    def __init__(self, model, config, kind):
        super().__init__(model, None)
        self.hf = True
        self.kind = kind
        self.config = config
        self.vocab = getattr(config, "vocab_size", None)
        if kind == "image-classification":
            self.context = None
            self.default_seq = getattr(config, "image_size", 224)
        else:
            self.context = context_length(model, config)
            self.default_seq = self.context or 512

    def inputs(self, batch, seq):
        if self.kind == "image-classification":
            channels = getattr(self.config, "num_channels", 3)
            # In the model's type, as pipelines pass images to a model cast
            # to bf16 or fp16 (a convolution refuses float32 input then).
            dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
            return dict(pixel_values=torch.randn(batch, channels, seq, seq, device="meta", dtype=dtype),
                        labels=torch.zeros(batch, dtype=torch.long, device="meta"))
        ids = _ids(batch, seq, self.vocab or 2)
        if self.kind == "sequence-classification":
            return dict(input_ids=ids, labels=torch.zeros(batch, dtype=torch.long, device="meta"))
        return dict(input_ids=ids, labels=ids)


def _transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise PlanError(f"hf: models and config.json files need transformers ({err}); pip install transformers") from None
    import transformers

    return transformers


def _coerce(text):
    """--set values: JSON when they parse (numbers, true, null, lists), else strings."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def hf_config(spec, overrides):
    """The transformers configuration MODEL names, with --set overrides."""
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if spec.startswith("hf:"):
        model_type = spec[3:]
        if model_type not in CONFIG_MAPPING:
            near = sorted(t for t in CONFIG_MAPPING.keys() if model_type.lower() in t or t in model_type.lower())[:8]
            hint = f" (did you mean {', '.join(near)}?)" if near else " (see transformers' model_type names: gpt2, llama, bert, vit, ...)"
            raise PlanError(f"{spec}: unknown architecture {model_type!r}{hint}")
        data = {}
    else:
        path = spec
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise PlanError(f"{spec}: no such file (MODEL is hf:TYPE, a config.json, or module:pkg.mod:factory)") from None
        except json.JSONDecodeError as err:
            raise PlanError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise PlanError(f"{path}: a configuration is a JSON object, found {type(data).__name__}")
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise PlanError(f"{path}: no \"model_type\" field (transformers needs it to know the architecture)")
        if model_type not in CONFIG_MAPPING:
            raise PlanError(f"{path}: field \"model_type\": unknown architecture {model_type!r}")
    defaults = transformers.AutoConfig.for_model(model_type)
    for key in overrides:
        if not hasattr(defaults, key):
            raise PlanError(f"--set {key}: {type(defaults).__name__} has no field {key!r}")
    # Built with the overrides, so that fields derived from others (a
    # head size from the width and the heads) follow them.
    try:
        return transformers.AutoConfig.for_model(model_type, **{**data, **overrides})
    except (TypeError, ValueError) as err:
        raise PlanError(f"{spec}: {err}") from None


def _task_kind(config, task):
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    if task == "generate":
        if model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise PlanError(f"--task generate needs a causal language model; {model_type} is not one")
        return "causal-lm"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return "masked-lm"
    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal-lm"
    if model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq-lm"
    if model_type in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "image-classification"
    if model_type in auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        return "sequence-classification"
    raise PlanError(f"{model_type}: no causal LM, masked LM, sequence-to-sequence LM, image or sequence classification "
                    "head in transformers")


def build(spec, overrides, task):
    """The Workload MODEL names, built on the meta device."""
    if spec.startswith("module:"):
        if overrides:
            raise PlanError("--set changes transformers configurations; a module: factory takes none")
        return _from_factory(spec)
    config = hf_config(spec, overrides)
    transformers = _transformers()
    kind = _task_kind(config, task)
    if kind == "seq2seq-lm" and getattr(config, "decoder_start_token_id", None) is None:
        # Default configurations leave it to the generation config; training
        # shifts the labels right by it (the pad token, by T5's convention).
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    auto = {
        "causal-lm": transformers.AutoModelForCausalLM,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
        "image-classification": transformers.AutoModelForImageClassification,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
    }[kind]
    if getattr(config, "architectures", None) is None:
        # transformers iterates it to choose among several classes of one
        # task (DeiT's two image classifiers) and fails on None: [] takes the first.
        config.architectures = []
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except (ValueError, TypeError, AttributeError) as err:
        raise PlanError(f"{spec}: transformers cannot build {config.model_type} from this configuration: {err}") from None
    if kind == "causal-lm" and getattr(model, "loss_type", "") is None:
        # A class whose name transformers does not map to a loss (GPT-2's
        # GPT2LMHeadModel) falls back to the causal LM loss, warning at each
        # run that loss_type=None is unrecognized: name that loss, the same.
        model.loss_type = "ForCausalLM"
    return _HuggingFace(model, config, kind)


def _from_factory(spec):
    parts = spec[len("module:"):].split(":")
    if len(parts) != 2 or not all(parts):
        raise PlanError(f"{spec}: expected module:pkg.mod:factory")
    module_name, attr = parts
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise PlanError(f"{spec}: no module named {module_name!r} (is it on PYTHONPATH?)") from None
        raise FactoryError(_traceback()) from None
    except Exception:  # noqa: BLE001 - the user's module failed to import: show its traceback
        raise FactoryError(_traceback()) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PlanError(f"{spec}: {module_name} has no callable {attr!r}")
    try:
        with torch.device("meta"):
            made = factory()
    except Exception:  # noqa: BLE001 - the user's factory raised: show its traceback
        raise FactoryError(_traceback()) from None
    optimizer = None
    if isinstance(made, tuple):
        if len(made) != 2:
            raise PlanError(f"{spec}: the factory returned a tuple of {len(made)}; expected (model, optimizer)")
        made, optimizer = made
        if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
            raise PlanError(f"{spec}: the factory returned (model, {type(optimizer).__name__}); expected the "
                            "optimizer as a torch.optim.Optimizer or a callable making one from the parameters")
    work = _workload(spec, made)
    work.optimizer = optimizer
    return work


def _workload(spec, made):
    """What a factory returned as a Workload, its signatures checked."""
    if isinstance(made, Workload):
        if not isinstance(made.model, torch.nn.Module):
            raise PlanError(f"{spec}: the Workload's model is {type(made.model).__name__}; expected an nn.Module")
        _takes(spec, made.make_batch, "make_batch", "(batch, seq)", 2)
        if made.loss_fn is not None:
            _takes(spec, made.loss_fn, "loss", "(output, inputs)", 2)
        return made
    if isinstance(made, torch.nn.Module):
        _takes(spec, made.forward, type(made).__name__, "token ids alone (a (batch, seq) tensor)", 1,
               hint="; return a tidepool.workload.Workload(model, make_batch, loss) to feed it other inputs")
        vocab = None
        for m in made.modules():
            if isinstance(m, torch.nn.Embedding):
                vocab = m.num_embeddings
                break
        return _TokensToLogits(made, vocab)
    raise PlanError(f"{spec}: the factory returned {type(made).__name__}; expected an nn.Module, a "
                    "tidepool.workload.Workload, or a tuple (model, optimizer)")


def _takes(spec, function, name, arguments, count, hint=""):
    """`function` can be called with `count` positional arguments."""
    if not callable(function):
        raise PlanError(f"{spec}: the Workload's {name} is {type(function).__name__}; expected a callable")
    import inspect

    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its call will say
    try:
        signature.bind(*[None] * count)
    except TypeError:
        raise PlanError(f"{spec}: {name} is called with {arguments}, but its signature is {signature}{hint}") from None


def _traceback():
    import traceback

    return traceback.format_exc()
