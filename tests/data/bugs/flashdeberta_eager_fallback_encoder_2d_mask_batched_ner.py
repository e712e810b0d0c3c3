# Knowledgator/FlashDeBERTa PR #6 (commit 394604d, "GLiNER#263 Fix get_attention_mask function that allows
# for batched inference"; urchade/GLiNER#263 "flashdeberta breaks `batch_predict_entities`").
# FlashDebertaV2Encoder overrode DebertaV2Encoder.get_attention_mask to return the (B, L) padding mask as is
# (the Triton varlen path wants it that way). When the model runs the eager DisentangledSelfAttention (CPU, no
# Triton kernel), that (B, L) mask meets scores of shape (B, H, L, L) in masked_fill. The fix builds the
# (B, 1, L, L) query x key mask there, as DebertaV2Encoder does.
# Here: token classification (NER tagging) over a right-padded batch of 6 sentences padded to 6 tokens.
import sys

import torch
from torch import nn
from transformers.models.deberta_v2.modeling_deberta_v2 import (
    DebertaV2Attention,
    DebertaV2Config,
    DebertaV2Encoder,
    DebertaV2ForTokenClassification,
    DebertaV2Intermediate,
    DebertaV2Layer,
    DebertaV2Model,
    DebertaV2Output,
    DebertaV2SelfOutput,
    DisentangledSelfAttention,
)

FIXED = "--fixed" in sys.argv

# FlashDisentangledSelfAttention needs the Triton kernels (GPU); on CPU the eager class is used.
DEBERTA_SELF_ATTENTION_CLASSES = {
    "eager": DisentangledSelfAttention,
}


class FlashDebertaV2Attention(DebertaV2Attention):
    def __init__(self, config):
        super().__init__(config)
        self.self = DEBERTA_SELF_ATTENTION_CLASSES[config._attn_implementation](config)
        self.output = DebertaV2SelfOutput(config)
        self.config = config


class FlashDebertaV2Layer(DebertaV2Layer):
    def __init__(self, config):
        super().__init__(config)
        self.attention = FlashDebertaV2Attention(config)
        self.intermediate = DebertaV2Intermediate(config)
        self.output = DebertaV2Output(config)


class FlashDebertaV2Encoder(DebertaV2Encoder):
    def __init__(self, config):
        super().__init__(config)
        self.layer = nn.ModuleList([FlashDebertaV2Layer(config) for _ in range(config.num_hidden_layers)])

    def get_attention_mask(self, attention_mask):
        if FIXED:
            if attention_mask.dim() <= 2:
                extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
                attention_mask = extended_attention_mask * extended_attention_mask.squeeze(-2).unsqueeze(-1)
            elif attention_mask.dim() == 3:
                attention_mask = attention_mask.unsqueeze(1)

        return attention_mask


class FlashDebertaV2Model(DebertaV2Model):
    def __init__(self, config):
        super().__init__(config)
        self.encoder = FlashDebertaV2Encoder(config)
        self.z_steps = 0
        self.post_init()


class FlashDebertaV2ForTokenClassification(DebertaV2ForTokenClassification):
    def __init__(self, config):
        super().__init__(config)
        self.deberta = FlashDebertaV2Model(config)
        self.post_init()


def main():
    torch.manual_seed(0)
    config = DebertaV2Config(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        relative_attention=True,
        position_buckets=16,
        max_relative_positions=-1,
        pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        position_biased_input=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        num_labels=5,
    )
    config._attn_implementation = "eager"
    model = FlashDebertaV2ForTokenClassification(config).eval()

    # [CLS]=1, [SEP]=2, pad=0; right padding, as the tokenizer pads a batch
    sentences = [
        [1, 11, 12, 13, 14, 2],
        [1, 21, 22, 2],
        [1, 31, 32, 33, 2],
        [1, 41, 2],
        [1, 51, 52, 53, 54, 2],
        [1, 61, 62, 2],
    ]
    max_len = max(len(s) for s in sentences)
    input_ids = torch.zeros(len(sentences), max_len, dtype=torch.long)
    attention_mask = torch.zeros(len(sentences), max_len, dtype=torch.long)
    for i, s in enumerate(sentences):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1

    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    preds = logits.argmax(-1)
    for i, s in enumerate(sentences):
        tags = preds[i, 1 : len(s) - 1].tolist()
        print(f"sentence {i}: tags {tags} logits[1] {logits[i, 1].numpy().round(4).tolist()}")


if __name__ == "__main__":
    main()
