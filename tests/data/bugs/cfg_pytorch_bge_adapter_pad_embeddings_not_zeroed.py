"""classifier-free-guidance-pytorch: the BGE text adapter hands back non-zero embeddings at padded tokens.

Citation: lucidrains/classifier-free-guidance-pytorch#7 (commits e8c97d4, 22783fc, 98a1b05; merge 41fd672)
(classifier_free_guidance_pytorch/bge.py, ``BGEAdapter.embed_text``).

How the library masks text: it keeps no padding mask. ``AttentionTextConditioner`` derives the
cross-attention key mask from the embeddings themselves, ``mask = (text_embed !=
text_embed_pad_value).any(dim = -1)``, so each text adapter must write ``text_embed_pad_value`` into
the positions of padding tokens (the T5 adapter does ``encoded_text.masked_fill_(~attn_mask[..., None],
self.text_embed_pad_value)``).

The bug: ``BGEAdapter.embed_text(..., return_text_encodings = True)`` returned
``model_output.last_hidden_state`` as it came out of BERT. The hidden states of padded positions
are not zero, so the derived mask is all True and every conditioned hidden feature cross-attends the
padding tokens of the shorter prompts in the batch (in both the conditional and, through the same
embeddings, the guided forward).

The fix: ``encoded_text = encoded_text.masked_fill_(~attn_mask[..., None], self.text_embed_pad_value)``
using the tokenizer's attention mask.

This program ports the library's AttentionTextConditioner / CrossAttention / Attention / Attend
(flash path) and the ``classifier_free_guidance_class_decorator`` with the 'attention' condition
type, with einops/beartype written out in torch, and the BGE adapter on a tiny random BertModel built
from BertConfig with a small word vocabulary (``BAAI/bge-base-en-v1.5`` is not downloaded; the
adapter's ``.to("cuda")`` is the model's device). The conditioned network is a small channel-first
conv denoiser, guided with ``cond_scale = 3.``.
"""

import sys
from collections import namedtuple
from functools import partial, wraps
from inspect import signature
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Module, ModuleList

import transformers
from transformers import BertConfig, BertModel, BertTokenizer

transformers.logging.set_verbosity_error()

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# ---- helpers (classifier_free_guidance_pytorch.py) ----------------------------------------------
COND_DROP_KEY_NAME = 'cond_drop_prob'
TEXTS_KEY_NAME = 'texts'
TEXT_EMBEDS_KEY_NAME = 'text_embeds'
TEXT_CONDITIONER_NAME = 'text_conditioner'
CONDITION_FUNCTION_KEY_NAME = 'cond_fns'

TextCondReturn = namedtuple('TextCondReturn', ['embed', 'mask'])


def exists(val):
    return val is not None


def is_empty(l):
    return len(l) == 0


def default(*values):
    for value in values:
        if exists(value):
            return value
    return None


def cast_tuple(val, length = 1):
    return val if isinstance(val, tuple) else ((val,) * length)


def prob_mask_like(shape, prob, device):
    if prob == 1:
        return torch.ones(shape, device = device, dtype = torch.bool)
    elif prob == 0:
        return torch.zeros(shape, device = device, dtype = torch.bool)
    else:
        return torch.zeros(shape, device = device).float().uniform_(0, 1) < prob


# ---- bge.py -------------------------------------------------------------------------------------
BGE_WORDS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'a', 'an', 'the', 'red', 'blue', 'green', 'small',
             'large', 'cube', 'sphere', 'cone', 'on', 'next', 'to', 'under', 'table', 'floor', 'of', 'and']


class BGEAdapter():
    def __init__(
        self,
        name,
        text_embed_pad_value = 0.
    ):
        name = 'BAAI/bge-base-en-v1.5'
        # stand-ins for AutoTokenizer / AutoModel / AutoConfig.from_pretrained(name)
        tokenizer = BertTokenizer(vocab = {w: i for i, w in enumerate(BGE_WORDS)})
        self.Config = BertConfig(vocab_size = len(BGE_WORDS), hidden_size = 32, num_hidden_layers = 2,
                                 num_attention_heads = 2, intermediate_size = 64, max_position_embeddings = 64)
        model = BertModel(self.Config)

        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.text_embed_pad_value = text_embed_pad_value

    @property
    def dim_latent(self):
        return self.Config.hidden_size

    @property
    def max_text_len(self):
        return 512

    @torch.no_grad()
    def embed_text(
        self,
        texts: List[str],
        return_text_encodings = False,
        output_device = None
    ):
        encoded_input = self.tokenizer(texts, padding=True, truncation=True, return_tensors='pt').to(self.model.device)

        self.model.eval()

        with torch.no_grad():
            model_output = self.model(**encoded_input)

        if not return_text_encodings:
            sentence_embeddings = model_output[0][:, 0]
            sentence_embeddings = torch.nn.functional.normalize(sentence_embeddings, p=2, dim=1)
            return sentence_embeddings  # Return normalized CLS embedding

        if not FIXED:
            return model_output.last_hidden_state.to(output_device)

        encoded_text = model_output.last_hidden_state.to(output_device)
        attn_mask = encoded_input.attention_mask.bool()

        encoded_text = encoded_text.masked_fill_(~attn_mask[..., None], self.text_embed_pad_value)

        return encoded_text


# ---- attend.py (flash path) ---------------------------------------------------------------------
EfficientAttentionConfig = namedtuple('EfficientAttentionConfig', ['enable_flash', 'enable_math', 'enable_mem_efficient'])


class Attend(nn.Module):
    def __init__(self, dropout = 0., causal = False, flash = False):
        super().__init__()
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)
        self.causal = causal
        self.flash = flash
        self.cpu_config = EfficientAttentionConfig(True, True, True)
        self.cuda_config = None

    def flash_attn(self, q, k, v, mask = None):
        _, heads, q_len, _, k_len, is_cuda = *q.shape, k.shape[-2], q.is_cuda

        if k.ndim == 3:
            k = k.unsqueeze(1).expand(-1, heads, -1, -1)   # repeat(k, 'b ... -> b h ...', h = heads)

        if v.ndim == 3:
            v = v.unsqueeze(1).expand(-1, heads, -1, -1)

        # The mask is B L, so it would have to be expanded to B H N L
        if exists(mask):
            if mask.ndim == 2:
                mask = mask[:, None, None, :]              # rearrange(mask, 'b j -> b 1 1 j')
            mask = mask.expand(-1, heads, q_len, -1)

        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask = mask,
            dropout_p = self.dropout if self.training else 0.,
            is_causal = self.causal
        )
        return out

    def forward(self, q, k, v, mask = None):
        if self.flash:
            return self.flash_attn(q, k, v, mask = mask)

        scale = q.shape[-1] ** -0.5
        sim = torch.einsum('b h i d, b j d -> b h i j' if k.ndim == 3 else 'b h i d, b h j d -> b h i j', q, k) * scale
        if exists(mask):
            if mask.ndim == 2:
                mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        return torch.einsum('b h i j, b j d -> b h i d' if v.ndim == 3 else 'b h i j, b h j d -> b h i d', attn, v)


# ---- attention / cross attention (classifier_free_guidance_pytorch.py) --------------------------
class Attention(Module):
    def __init__(self, dim, dim_head = 64, heads = 8, dim_context = None, norm_context = False, num_null_kv = 0,
                 flash = False):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        inner_dim = dim_head * heads

        dim_context = default(dim_context, dim)

        self.norm = nn.LayerNorm(dim)
        self.context_norm = nn.LayerNorm(dim_context) if norm_context else nn.Identity()

        self.attend = Attend(flash = flash)

        self.num_null_kv = num_null_kv
        self.null_kv = nn.Parameter(torch.randn(2, num_null_kv, dim_head))

        self.to_q = nn.Linear(dim, inner_dim, bias = False)
        self.to_kv = nn.Linear(dim_context, dim_head * 2, bias = False)
        self.to_out = nn.Linear(inner_dim, dim, bias = False)

    def forward(self, x, context = None, mask = None):
        b = x.shape[0]

        if exists(context):
            context = self.context_norm(context)

        kv_input = default(context, x)

        x = self.norm(x)

        q, k, v = self.to_q(x), *self.to_kv(kv_input).chunk(2, dim = -1)

        if self.num_null_kv > 0:
            null_k, null_v = self.null_kv.unsqueeze(1).expand(-1, b, -1, -1).unbind(dim = 0)  # 'kv n d -> kv b n d'
            k = torch.cat((null_k, k), dim = -2)
            v = torch.cat((null_v, v), dim = -2)

        if exists(mask):
            mask = F.pad(mask, (self.num_null_kv, 0), value = True)
            mask = mask[:, None, None, :]                  # 'b j -> b 1 1 j'

        q = q.unflatten(-1, (self.heads, -1)).transpose(1, 2)   # 'b n (h d) -> b h n d'

        out = self.attend(q, k, v, mask = mask)

        out = out.transpose(1, 2).flatten(2)               # 'b h n d -> b n (h d)'
        return self.to_out(out)


def rearrange_channel_last(fn):
    @wraps(fn)
    def inner(hiddens):
        shape = hiddens.shape
        hiddens = hiddens.reshape(shape[0], -1, shape[-1])  # pack_one(hiddens, 'b * d')
        conditioned = fn(hiddens)
        return conditioned.reshape(shape)
    return inner


def rearrange_channel_first(fn):
    """ will adapt shape of (batch, feature, ...) for conditioning """

    @wraps(fn)
    def inner(hiddens):
        shape = hiddens.shape
        hiddens = hiddens.reshape(shape[0], shape[1], -1)  # pack_one(hiddens, 'b d *')
        hiddens = hiddens.transpose(1, 2)                   # 'b d n -> b n d'
        conditioned = fn(hiddens)
        conditioned = conditioned.transpose(1, 2)           # 'b n d -> b d n'
        return conditioned.reshape(shape)

    return inner


class CrossAttention(Module):
    def __init__(self, dim, hidden_dim, heads = 8, dim_head = 64, flash = False):
        super().__init__()
        self.attn = Attention(
            dim = hidden_dim,
            dim_context = dim,
            norm_context = True,
            num_null_kv = 1,
            dim_head = dim_head,
            heads = heads,
            flash = flash
        )

    def forward(self, condition, hiddens, mask = None):
        return self.attn(hiddens, condition, mask = mask) + hiddens


CONDITION_CONFIG = dict(
    bge = BGEAdapter
)

MODEL_TYPES = CONDITION_CONFIG.keys()


class Conditioner(Module):
    pass


class AttentionTextConditioner(Conditioner):
    def __init__(
        self,
        *,
        hidden_dims: Tuple[int, ...],
        model_types = 't5',
        model_names = None,
        cond_drop_prob = 0.,
        hiddens_channel_first = True,
        dim_latent = None,
        attn_dim_head = 64,
        attn_heads = 8,
        flash = True,
        text_embed_pad_value = 0.
    ):
        super().__init__()
        model_types = cast_tuple(model_types)
        model_names = cast_tuple(model_names, length = len(model_types))

        text_models = []
        for model_type, model_name in zip(model_types, model_names):
            klass = CONDITION_CONFIG.get(model_type)
            model = klass(model_name, text_embed_pad_value = text_embed_pad_value)
            text_models.append(model)

        self.text_models = text_models

        self.to_latent_dims = ModuleList([])

        dim_latent = default(dim_latent, max([model.dim_latent for model in text_models]))

        self.dim_latent = dim_latent

        for model in text_models:
            self.to_latent_dims.append(nn.Linear(model.dim_latent, dim_latent))

        self.conditioners = ModuleList([])

        self.hidden_dims = hidden_dims
        self.num_condition_fns = len(hidden_dims)
        self.hiddens_channel_first = cast_tuple(hiddens_channel_first, self.num_condition_fns)

        self.text_embed_pad_value = text_embed_pad_value
        self.cond_drop_prob = cond_drop_prob

        for hidden_dim in hidden_dims:
            self.conditioners.append(CrossAttention(dim_latent, hidden_dim, flash = flash))

        self.register_buffer('_device_param', torch.tensor(0), persistent = False)

    @property
    def device(self):
        return next(self.buffers()).device

    def embed_texts(self, texts: List[str]):
        device = self.device

        text_embeds = []

        for text_model, to_latent in zip(self.text_models, self.to_latent_dims):
            text_embed = text_model.embed_text(texts, return_text_encodings = True)

            text_embed = text_embed.to(device)

            mask = (text_embed != self.text_embed_pad_value).any(dim = -1)

            text_embed = to_latent(text_embed)
            text_embed = text_embed.masked_fill(~mask[..., None], 0.)

            text_embeds.append(text_embed)

        return torch.cat(text_embeds, dim = -2)

    def forward(self, texts: List[str] | None = None, text_embeds: torch.Tensor | None = None, cond_drop_prob = None,
                repeat_batch = 1):
        assert exists(texts) or exists(text_embeds)

        if exists(text_embeds) and exists(texts):
            texts = None

        if self.training:
            cond_drop_prob = default(cond_drop_prob, self.cond_drop_prob)
        else:
            assert exists(cond_drop_prob), 'when not training, cond_drop_prob must be explicitly set'

        if exists(texts):
            batch = len(texts)
        elif exists(text_embeds):
            batch = text_embeds.shape[0]

        if not exists(text_embeds):
            text_embeds = self.embed_texts(texts)

        mask = (text_embeds != self.text_embed_pad_value).any(dim = -1)

        if cond_drop_prob > 0.:
            prob_keep_mask = prob_mask_like((batch, 1), 1. - cond_drop_prob, device = self.device)
            mask = mask & prob_keep_mask

        repeat_batch = cast_tuple(repeat_batch, self.num_condition_fns)

        cond_fns = []

        for cond, cond_hiddens_channel_first, cond_repeat_batch in zip(self.conditioners, self.hiddens_channel_first,
                                                                        repeat_batch):
            cond_text_embeds = text_embeds.repeat_interleave(cond_repeat_batch, dim = 0)  # 'b ... -> (b r) ...'
            cond_mask = mask.repeat_interleave(cond_repeat_batch, dim = 0) if exists(mask) else None

            cond_fn = partial(cond, cond_text_embeds, mask = cond_mask)

            wrapper_fn = rearrange_channel_first if cond_hiddens_channel_first else rearrange_channel_last

            cond_fns.append(wrapper_fn(cond_fn))

        return tuple(cond_fns), TextCondReturn(text_embeds, mask)


# ---- classifier free guidance decorators --------------------------------------------------------
def classifier_free_guidance(
    fn: Callable,
    cond_drop_prob_keyname = COND_DROP_KEY_NAME,
    texts_key_name = TEXTS_KEY_NAME,
    text_embeds_key_name = TEXT_EMBEDS_KEY_NAME,
    cond_fns_keyname = CONDITION_FUNCTION_KEY_NAME,
    text_conditioner_name = TEXT_CONDITIONER_NAME
):
    fn_params = signature(fn).parameters

    auto_handle_text_condition = texts_key_name not in fn_params and text_embeds_key_name not in fn_params

    @wraps(fn)
    def inner(self, *args, cond_scale: float = 1., rescale_phi: float = 0.,
              cfg_routed_kwargs: Dict[str, Tuple[Any, Any]] = dict(), **kwargs):
        @wraps(fn)
        def fn_maybe_with_text(self, *args, **kwargs):
            if auto_handle_text_condition:
                texts = kwargs.pop('texts', None)
                text_embeds = kwargs.pop('text_embeds', None)

                raw_text_cond = cond_fns = None

                text_conditioner = getattr(self, text_conditioner_name, None)

                cond_drop_prob = kwargs.pop(cond_drop_prob_keyname, None)

                if exists(texts) ^ exists(text_embeds):
                    text_condition_input = dict(texts = texts) if exists(texts) else dict(text_embeds = text_embeds)
                    cond_fns, raw_text_cond = text_conditioner(**text_condition_input, cond_drop_prob = cond_drop_prob)

                if 'cond_fns' in fn_params:
                    kwargs.update(cond_fns = cond_fns)

                if 'raw_text_cond' in fn_params:
                    kwargs.update(raw_text_cond = raw_text_cond)

            return fn(self, *args, **kwargs)

        if self.training:
            assert cond_scale == 1, 'you cannot do condition scaling when in training mode'
            return fn_maybe_with_text(self, *args, **kwargs)

        kwargs_without_cond_dropout = {**kwargs, cond_drop_prob_keyname: 0.}
        kwargs_with_cond_dropout = {**kwargs, cond_drop_prob_keyname: 1.}

        fn_kwargs = {k: v[0] for k, v in cfg_routed_kwargs.items()}
        null_fn_kwargs = {k: v[1] for k, v in cfg_routed_kwargs.items()}

        outputs = fn_maybe_with_text(self, *args, **fn_kwargs, **kwargs_without_cond_dropout)

        if cond_scale == 1:
            return outputs

        logits, *rest = cast_tuple(outputs)

        null_outputs = fn_maybe_with_text(self, *args, **null_fn_kwargs, **kwargs_with_cond_dropout)

        null_logits, *null_rest = cast_tuple(null_outputs)

        zipped_rest = tuple(zip(rest, null_rest))

        scaled_logits = null_logits + (logits - null_logits) * cond_scale

        if rescale_phi <= 0:
            logit_output = scaled_logits
        else:
            dims = tuple(range(1, logits.ndim - 1))
            rescaled_logits = scaled_logits * (logits.std(dim = dims, keepdim = True) /
                                               scaled_logits.std(dim = dims, keepdim = True))
            logit_output = rescaled_logits * rescale_phi + scaled_logits * (1. - rescale_phi)

        if is_empty(zipped_rest):
            return logit_output

        return (logit_output, *zipped_rest)

    return inner


def classifier_free_guidance_class_decorator(orig_class):
    orig_init = orig_class.__init__

    @wraps(orig_init)
    def __init__(self, *args, text_condition_type = 'film', text_condition_model_types: Tuple[str, ...] = ('t5',),
                 text_condition_hidden_dims: Tuple[int, ...], text_condition_cond_drop_prob: float, **kwargs):
        orig_init(self, *args, **kwargs)

        assert text_condition_type == 'attention'   # only the cross attention conditioner is ported here
        condition_klass = AttentionTextConditioner

        self.text_conditioner = condition_klass(
            model_types = text_condition_model_types,
            hidden_dims = text_condition_hidden_dims,
            cond_drop_prob = text_condition_cond_drop_prob
        )

    orig_class.__init__ = __init__
    orig_class.forward = classifier_free_guidance(orig_class.forward)
    return orig_class


# ---- a user network, as in the README's "Magic Class Decorator" example -------------------------
@classifier_free_guidance_class_decorator
class Denoiser(nn.Module):
    def __init__(self, channels, dim):
        super().__init__()
        self.proj_in = nn.Sequential(nn.Conv2d(channels, dim * 2, 3, padding = 1), nn.SiLU())
        self.proj_mid = nn.Sequential(nn.Conv2d(dim * 2, dim, 3, padding = 1), nn.SiLU())
        self.proj_out = nn.Conv2d(dim, channels, 3, padding = 1)

    def forward(self, inp, cond_fns):
        cond_hidden1, cond_hidden2 = cond_fns

        hiddens1 = self.proj_in(inp)
        hiddens1 = cond_hidden1(hiddens1)

        hiddens2 = self.proj_mid(hiddens1)
        hiddens2 = cond_hidden2(hiddens2)

        return self.proj_out(hiddens2)


def main():
    model = Denoiser(
        channels = 3,
        dim = 16,
        text_condition_type = 'attention',
        text_condition_model_types = ('bge',),
        text_condition_hidden_dims = (32, 16),
        text_condition_cond_drop_prob = 0.25
    )

    data = torch.randn(2, 3, 8, 8)
    texts = ['a red cube', 'a small blue sphere next to the green cone on the table']

    model.eval()
    with torch.no_grad():
        guided_pred = model(data, texts = texts, cond_scale = 3.)

    print("fixed" if FIXED else "buggy", "guided prediction", tuple(guided_pred.shape))
    for i, text in enumerate(texts):
        print(f"  {text!r}: mean {guided_pred[i].mean().item():.6f}  abs-sum {guided_pred[i].abs().sum().item():.6f}")


if __name__ == "__main__":
    main()
