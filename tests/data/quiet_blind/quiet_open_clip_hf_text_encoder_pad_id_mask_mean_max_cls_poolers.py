# Correct program (quiet batch quiet-r67b).
# Ported from mlfoundations/open_clip @89fb801f1e6087880e951fc8354b8a2077b79c6d (hf_model.py last changed in
# 4630c0078a7234dcd06c1efb76a91575f841df82):
#   src/open_clip/hf_model.py (MeanPooler, MaxPooler, ClsPooler, register_pooler / _POOLERS, _auto_model_kwargs,
#     HFTextEncoder.__init__ on the `config` branch and HFTextEncoder.forward: attn_mask = (x != pad_token_id),
#     the pooler given the same mask, proj 'linear' / 'mlp'),
#   src/open_clip/hf_configs.py (arch_dict entries for xlm-roberta, mt5, modernbert, bert: width name and the default
#     pooler),
#   src/open_clip/tokenizer.py (HFTokenizer.__call__: whitespace clean, padding='max_length' to the context length,
#     truncation, padding_side forced to 'right'),
#   src/open_clip/model.py (CustomTextCLIP.__init__ / _encode_text / forward, logit_scale),
#   src/open_clip/loss.py (ClipLoss single process: logits_per_image / logits_per_text, the mean of both cross
#     entropies).
# Four Hugging Face text towers, each a tiny config built in memory (no download): XLM-RoBERTa with the default
# mean_pooler and an 'mlp' projection, the mT5 encoder (pad id 0) with mean_pooler, ModernBERT (local layers with a
# 4-token window) with max_pooler, and BERT with cls_pooler (by default without the HF pooling layer, the first
# token's state; named explicitly, with the pooling layer and its pooler_output). Each tokenizer is a
# word-level PreTrainedTokenizerFast built in memory with that model's special tokens; HFTokenizer pads every caption
# to the 24-token context on the right, and HFTextEncoder rebuilds the mask from the pad id, hands it to the model,
# and pools with it. The vision tower is a stand-in (a linear map of a flattened tiny image): only the text side is
# ported.
# Self-check: each caption alone, its ids without pads, through the same transformer with no mask; the mean (or max)
# of its token states, or BERT's pooler output, then the projection and the L2 normalisation is its reference
# feature. The padded batch's features, the CLIP logits (a double loop of dot products) and ClipLoss must match.
import html
import re
import sys
from typing import List, Optional, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import TensorType
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (AutoModel, BertConfig, ModernBertConfig, MT5Config, PretrainedConfig,
                          PreTrainedTokenizerFast, XLMRobertaConfig)
from transformers.modeling_outputs import (BaseModelOutput, BaseModelOutputWithPooling,
                                           BaseModelOutputWithPoolingAndCrossAttentions)

torch.manual_seed(0)

# --- src/open_clip/hf_configs.py (the entries used here) ---
arch_dict = {
    "xlm-roberta": {"config_names": {"context_length": "max_position_embeddings", "vocab_size": "vocab_size",
                                     "width": "hidden_size", "heads": "num_attention_heads",
                                     "layers": "num_hidden_layers", "layer_attr": "layer",
                                     "token_embeddings_attr": "embeddings"},
                    "pooler": "mean_pooler"},
    "mt5": {"config_names": {"context_length": "", "vocab_size": "vocab_size", "width": "d_model",
                             "heads": "num_heads", "layers": "num_layers", "layer_attr": "block",
                             "token_embeddings_attr": "embed_tokens"},
            "pooler": "mean_pooler"},
    "bert": {"config_names": {"context_length": "max_position_embeddings", "vocab_size": "vocab_size",
                              "width": "hidden_size", "heads": "num_attention_heads",
                              "layers": "num_hidden_layers", "layer_attr": "layer",
                              "token_embeddings_attr": "embeddings"},
             "pooler": "cls_pooler"},
    "modernbert": {"config_names": {"context_length": "max_position_embeddings", "vocab_size": "vocab_size",
                                    "width": "hidden_size", "heads": "num_attention_heads",
                                    "layers": "num_hidden_layers", "layer_attr": "layers",
                                    "token_embeddings_attr": "embeddings"},
                   "pooler": "mean_pooler"},
}


# --- src/open_clip/hf_model.py ---
def _camel2snake(s):
    return re.sub(r'(?<!^)(?=[A-Z])', '_', s).lower()


_POOLERS = {}


def register_pooler(cls):
    """Decorator registering pooler class"""
    _POOLERS[_camel2snake(cls.__name__)] = cls
    return cls


@register_pooler
class MeanPooler(nn.Module):
    """Mean pooling"""

    def forward(self, x: BaseModelOutput, attention_mask: TensorType):
        masked_output = x.last_hidden_state * attention_mask.unsqueeze(-1)
        return masked_output.sum(dim=1) / attention_mask.sum(-1, keepdim=True)


@register_pooler
class MaxPooler(nn.Module):
    """Max pooling"""

    def forward(self, x: BaseModelOutput, attention_mask: TensorType):
        masked_output = x.last_hidden_state.masked_fill(~attention_mask.bool().unsqueeze(-1), -torch.inf)
        return masked_output.max(1).values


@register_pooler
class ClsPooler(nn.Module):
    """CLS token pooling"""

    def __init__(self, use_pooler_output=True):
        super().__init__()
        self.cls_token_position = 0
        self.use_pooler_output = use_pooler_output

    def forward(self, x: BaseModelOutput, attention_mask: TensorType):
        if (self.use_pooler_output and
            isinstance(x, (BaseModelOutputWithPooling, BaseModelOutputWithPoolingAndCrossAttentions)) and
            (x.pooler_output is not None)
        ):
            return x.pooler_output

        return x.last_hidden_state[:, self.cls_token_position, :]


_MODEL_TYPES_WITH_POOLING_LAYER_KWARG = {"bert", "roberta", "xlm-roberta"}


def _auto_model_kwargs(config: PretrainedConfig, pooler_type: str):
    if config.model_type in _MODEL_TYPES_WITH_POOLING_LAYER_KWARG:
        return {"add_pooling_layer": pooler_type == "cls_pooler"}
    return {}


class HFTextEncoder(nn.Module):
    """HuggingFace model adapter (the `config` branch: built from a config, no pretrained weights)"""

    def __init__(
            self,
            model_name_or_path: str,
            output_dim: int,
            config: PretrainedConfig = None,
            pooler_type: str = None,
            proj_type: str = None,
            pretrained: bool = True,
            output_tokens: bool = False,
    ):
        super().__init__()
        self.output_tokens = output_tokens
        self.output_dim = output_dim
        self.config = config

        if hasattr(self.config, "dtype"):  # transformers >= 5 renamed torch_dtype -> dtype
            self.config.dtype = None
        else:
            self.config.torch_dtype = None

        model_kwargs = _auto_model_kwargs(self.config, pooler_type)
        if pooler_type is None:  # get default arch pooler
            pooler_type = (arch_dict[self.config.model_type]["pooler"])
        self.transformer = AutoModel.from_config(self.config, **model_kwargs)
        if getattr(self.config, "is_encoder_decoder", False):
            self.transformer = self.transformer.encoder

        self.vocab_size = getattr(self.config, 'vocab_size', 0)
        self.context_length = getattr(self.config, 'max_position_embeddings', 0)

        self.pooler = _POOLERS[pooler_type]()

        d_model = getattr(self.config, arch_dict[self.config.model_type]["config_names"]["width"])
        if (d_model == output_dim) and (proj_type is None):  # do we always need a proj?
            self.proj = nn.Identity()
        elif proj_type == 'linear':
            self.proj = nn.Linear(d_model, output_dim, bias=False)
        elif proj_type == 'mlp':
            hidden_size = (d_model + output_dim) // 2
            self.proj = nn.Sequential(
                nn.Linear(d_model, hidden_size, bias=False),
                nn.GELU(),
                nn.Linear(hidden_size, output_dim, bias=False),
            )

    def forward(self, x: TensorType):
        attn_mask = (x != self.config.pad_token_id).long()
        out = self.transformer(input_ids=x, attention_mask=attn_mask)
        pooled_out = self.pooler(out, attn_mask)
        projected = self.proj(pooled_out)

        seq_len = out.last_hidden_state.shape[1]
        tokens = (
            out.last_hidden_state[:, torch.arange(seq_len) != self.pooler.cls_token_position, :]
            if type(self.pooler) == ClsPooler
            else out.last_hidden_state
        )

        if self.output_tokens:
            return projected, tokens
        return projected


# --- src/open_clip/tokenizer.py (HFTokenizer, standard mode; the tokenizer object handed in) ---
def basic_clean(text):
    # ftfy.fix_text(text) first in open_clip; ftfy is not installed here and the captions are plain ASCII
    text = html.unescape(html.unescape(text))
    return text.strip()


def whitespace_clean(text):
    text = " ".join(text.split())
    text = text.strip()
    return text


def _clean_whitespace(x):
    return whitespace_clean(basic_clean(x))


class HFTokenizer:
    def __init__(self, tokenizer, context_length: Optional[int] = 77, strip_sep_token: bool = False):
        self.context_length = context_length
        self.clean_fn = _clean_whitespace
        self.strip_sep_token = strip_sep_token
        self.tokenizer = tokenizer
        self.pad_token_id = self.tokenizer.pad_token_id
        # open_clip pooling and masking assume right-padded sequences (causal no-mask path, last/eos index math,
        # cls at position 0); force it for tokenizers that default to left padding (decoder-family).
        self.tokenizer.padding_side = 'right'

    def __call__(self, texts: Union[str, List[str]], context_length: Optional[int] = None, pad: bool = True):
        if isinstance(texts, str):
            texts = [texts]
        context_length = context_length or self.context_length
        texts = [self.clean_fn(text) for text in texts]
        encoded = self.tokenizer(
            texts,
            max_length=context_length,
            padding='max_length' if pad else False,
            truncation=True,
            return_tensors='pt' if pad else None,
        )
        input_ids = encoded.input_ids if pad else encoded["input_ids"]
        if not pad:
            return [torch.tensor(tokens, dtype=torch.long) for tokens in input_ids]
        return input_ids


# --- src/open_clip/model.py (CustomTextCLIP; the vision tower replaced by a stand-in) ---
class StandInVisual(nn.Module):
    def __init__(self, embed_dim, image_size=4):
        super().__init__()
        self.proj = nn.Linear(3 * image_size * image_size, embed_dim)

    def forward(self, image):
        return self.proj(image.flatten(1))


class CustomTextCLIP(nn.Module):
    def __init__(self, embed_dim: int, text: HFTextEncoder, init_logit_scale: float = np.log(1 / 0.07)):
        super().__init__()
        self.embed_dim = embed_dim
        self.visual = StandInVisual(embed_dim)
        self.text = text
        self.context_length = self.text.context_length
        self.vocab_size = self.text.vocab_size
        self.logit_scale = nn.Parameter(torch.ones([]) * init_logit_scale)
        self.logit_bias = None

    def _encode_image(self, image, normalize: bool = False):
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def _encode_text(self, text, normalize: bool = False):
        features = self.text(text)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, image=None, text=None):
        image_features = self._encode_image(image, normalize=True) if image is not None else None
        text_features = self._encode_text(text, normalize=True) if text is not None else None
        return image_features, text_features, self.logit_scale.exp()


# --- src/open_clip/loss.py (ClipLoss, world_size 1) ---
class ClipLoss(nn.Module):
    def get_logits(self, image_features, text_features, logit_scale):
        logits_per_image = logit_scale * image_features @ text_features.T
        logits_per_text = logit_scale * text_features @ image_features.T
        return logits_per_image, logits_per_text

    def forward(self, image_features, text_features, logit_scale):
        logits_per_image, logits_per_text = self.get_logits(image_features, text_features, logit_scale)
        labels = torch.arange(logits_per_image.shape[0], device=image_features.device, dtype=torch.long)
        total_loss = (
            F.cross_entropy(logits_per_image, labels) +
            F.cross_entropy(logits_per_text, labels)
        ) / 2
        return total_loss, logits_per_image, logits_per_text


# --- in-memory word-level tokenizers with each model's special tokens ---
WORDS = ("a photo of the dog cat on grass red car parked in street two people walking along beach at sunset "
         "small bird sitting branch close up an old man reading newspaper bench park bowl fruit table").split()


def build_tokenizer(arch):
    if arch == "xlm-roberta":
        specials, pad, unk, single, extra = ["<s>", "<pad>", "</s>", "<unk>"], "<pad>", "<unk>", "<s> $A </s>", \
            {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>"}
        st = [("<s>", 0), ("</s>", 2)]
    elif arch == "mt5":
        specials, pad, unk, single, extra = ["<pad>", "</s>", "<unk>"], "<pad>", "<unk>", "$A </s>", \
            {"eos_token": "</s>"}
        st = [("</s>", 1)]
    elif arch == "modernbert":
        specials, pad, unk, single, extra = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"], "[PAD]", "[UNK]", \
            "[CLS] $A [SEP]", {"cls_token": "[CLS]", "sep_token": "[SEP]"}
        st = [("[CLS]", 1), ("[SEP]", 2)]
    else:
        specials, pad, unk, single, extra = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[PAD]", "[UNK]", \
            "[CLS] $A [SEP]", {"cls_token": "[CLS]", "sep_token": "[SEP]"}
        st = [("[CLS]", 2), ("[SEP]", 3)]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=st)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk,
                                   model_input_names=["input_ids", "attention_mask"], **extra)


def build_config(arch, tokenizer):
    V, pad = len(tokenizer), tokenizer.pad_token_id
    if arch == "xlm-roberta":
        return XLMRobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=64, pad_token_id=pad,
                                bos_token_id=0, eos_token_id=2)
    if arch == "mt5":
        return MT5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1,
                         num_heads=4, relative_attention_num_buckets=8, pad_token_id=pad, eos_token_id=1,
                         decoder_start_token_id=pad, dropout_rate=0.0)
    if arch == "modernbert":
        return ModernBertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, max_position_embeddings=64, local_attention=4,
                                global_attn_every_n_layers=2, pad_token_id=pad, cls_token_id=1, sep_token_id=2,
                                bos_token_id=1, eos_token_id=2)
    return BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, pad_token_id=pad)


def reference_text_feature(text_tower, ids):
    # one caption alone: its ids without pads, no mask handed to the model
    out = text_tower.transformer(input_ids=torch.tensor([ids]))
    h = out.last_hidden_state[0]
    if isinstance(text_tower.pooler, MeanPooler):
        v = h.mean(0)
    elif isinstance(text_tower.pooler, MaxPooler):
        v = h.max(0).values
    elif getattr(out, "pooler_output", None) is not None:
        v = out.pooler_output[0]
    else:
        v = h[0]
    v = text_tower.proj(v[None])[0]
    return v / v.norm()


def run(arch, pooler_type, proj_type, captions, images):
    tokenizer = build_tokenizer(arch)
    config = build_config(arch, tokenizer)
    embed_dim = 16
    text = HFTextEncoder(arch, output_dim=embed_dim, config=config, pooler_type=pooler_type, proj_type=proj_type,
                         pretrained=False)
    model = CustomTextCLIP(embed_dim, text).eval()
    tok = HFTokenizer(tokenizer, context_length=24)

    ids = tok(captions)
    assert ids.shape == (len(captions), 24) and bool((ids == tokenizer.pad_token_id).any())
    with torch.no_grad():
        image_features, text_features, logit_scale = model(images, ids)
        loss, logits_per_image, logits_per_text = ClipLoss()(image_features, text_features, logit_scale)

        unpadded = tok(captions, pad=False)
        ref_text = torch.stack([reference_text_feature(text, t.tolist()) for t in unpadded])
        assert torch.allclose(text_features, ref_text, atol=1e-5), (arch, (text_features - ref_text).abs().max())

        n = len(captions)
        ref_lpi = torch.zeros(n, n)
        for i in range(n):
            for j in range(n):
                ref_lpi[i, j] = logit_scale * torch.dot(image_features[i], ref_text[j])
        ref_loss = 0.0
        for i in range(n):
            ref_loss += -(ref_lpi[i, i] - torch.logsumexp(ref_lpi[i], 0)) / 2
            ref_loss += -(ref_lpi[i, i] - torch.logsumexp(ref_lpi[:, i], 0)) / 2
        ref_loss = ref_loss / n
        assert torch.allclose(logits_per_image, ref_lpi, atol=1e-4), arch
        assert torch.allclose(logits_per_text, ref_lpi.T, atol=1e-4), arch
        assert abs(loss.item() - float(ref_loss)) < 1e-5, (arch, loss.item(), float(ref_loss))
    print(f"{arch:11s} {str(pooler_type):11s} {type(text.pooler).__name__:10s} ClipLoss {loss.item():.6f} == per-caption reference "
          f"{float(ref_loss):.6f}")


def main():
    captions = [
        "a photo of a dog",
        "a red car parked in the street",
        "two people   walking along the beach at sunset",
        "cat",
        "a close up of a small bird sitting on a branch in the park",
        "an old man reading the newspaper on a bench in the park at sunset",
    ]
    images = torch.randn(len(captions), 3, 4, 4)
    run("xlm-roberta", None, "mlp", captions, images)
    run("mt5", None, "linear", captions, images)
    run("modernbert", "max_pooler", "linear", captions, images)
    # pooler_type None: the arch default cls_pooler, built without the HF pooling layer (first token's state);
    # "cls_pooler" named: add_pooling_layer=True and the pooler output is read
    run("bert", None, "linear", captions, images)
    run("bert", "cls_pooler", "linear", captions, images)
    return 0


if __name__ == "__main__":
    sys.exit(main())
