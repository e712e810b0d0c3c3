# Tencent/TurboTransformers commit af84878 ("fix a bug in cpp mask", #95), example/cpp/bert_model.cpp.
# BertModel::Impl::operator() pads a batch of token-id lists to max_seq_len and fills masks_tensor itself;
# layers::PrepareBertMasks then turns it into extendedAttentionMask = -10000 * (1 - mask) (kernels::common::
# Transform), which BertAttention adds to q*k^T/sqrt(d) before the softmax (kernels::ApplyMaskAndSoftmax).
# Bug: the example filled the mask with 0 over each input's real tokens and 1 over its padding, so the real
# tokens got -10000 and the padding 0.
# Fix: fill 1 over the real tokens and 0 over the padding ("Bert_Attention use mask value as 1 to indicate a
# valid position").
# Ported to torch: the C++ preprocessing as written, PrepareBertMasks, the embedding / encoder layers (taken
# from a tiny transformers BertModel, as the example loads converted BERT weights), SequencePool and pooler.
import sys

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv

kFirst, kMean = 2, 1  # layers::types::PoolType { kMax = 0, kMean, kFirst, kLast }


def prepare_bert_masks(inputs, att_mask, seq_type, position_ids):
    """layers::PrepareBertMasks::operator()"""
    if position_ids is None:
        position_ids = torch.arange(inputs.shape[1], dtype=torch.int64).expand(inputs.shape[0], -1)
    if seq_type is None:
        seq_type = torch.zeros_like(inputs)
    if att_mask is None:
        att_mask = torch.ones_like(inputs)
    # cast att_mask to float: kernels::common::Transform, v -> -10000.0f * (1 - v)
    extended_attention_mask = (-10000.0 * (1 - att_mask)).to(torch.float32).view(att_mask.shape[0], 1, 1, att_mask.shape[1])
    return seq_type, position_ids, extended_attention_mask


def sequence_pool(hidden, pool_type):
    """layers::SequencePool"""
    if pool_type == kFirst:
        return hidden[:, 0]
    if pool_type == kMean:
        return hidden.mean(dim=1)
    raise ValueError(pool_type)


class BertModelImpl:
    """example/cpp/bert_model.cpp BertModel::Impl"""

    def __init__(self, config):
        torch.manual_seed(0)
        hf = BertModel(config, add_pooling_layer=True).eval()
        self.embedding_ = hf.embeddings
        self.encoders_ = list(hf.encoder.layer)
        self.pooler_ = hf.pooler

    @torch.no_grad()
    def __call__(self, inputs, poistion_ids, segment_ids, pooling, use_pooler):
        max_seq_len = max(len(input_ids) for input_ids in inputs)
        batch_size = len(inputs)
        inputs_tensor = torch.empty(batch_size, max_seq_len, dtype=torch.int64)
        masks_tensor = torch.empty(batch_size, max_seq_len, dtype=torch.int64)
        for i, input in enumerate(inputs):
            iptr, mptr = inputs_tensor[i], masks_tensor[i]
            iptr[: len(input)] = torch.tensor(input)  # std::copy(input.begin(), input.end(), iptr)
            if FIXED:
                mptr[: len(input)] = 1
                if len(input) != max_seq_len:
                    iptr[len(input):] = 0
                    mptr[len(input):] = 0
            else:
                mptr[: len(input)] = 0
                if len(input) != max_seq_len:
                    iptr[len(input):] = 0
                    mptr[len(input):] = 1
        input_ids = inputs_tensor

        seq_type = position_ids = None
        if len(poistion_ids) != 0:
            position_ids = torch.zeros(batch_size, max_seq_len, dtype=torch.int64)  # PadTensor(..., 0)
            for i, p in enumerate(poistion_ids):
                position_ids[i, : len(p)] = torch.tensor(p)
        if len(segment_ids) != 0:
            seq_type = torch.zeros(batch_size, max_seq_len, dtype=torch.int64)
            for i, s in enumerate(segment_ids):
                seq_type[i, : len(s)] = torch.tensor(s)

        seq_type, position_ids, extended_attention_mask = prepare_bert_masks(
            input_ids, masks_tensor, seq_type, position_ids)

        # start inference the BERT
        hidden = self.embedding_(input_ids=input_ids, token_type_ids=seq_type, position_ids=position_ids)
        for layer in self.encoders_:
            hidden = layer(hidden, attention_mask=extended_attention_mask)
            if isinstance(hidden, tuple):
                hidden = hidden[0]

        pooling_output = sequence_pool(hidden, pooling)
        if use_pooler:
            return self.pooler_.activation(self.pooler_.dense(pooling_output))
        return pooling_output


def main():
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    model = BertModelImpl(config)
    # three sentences of different lengths, [CLS] ... [SEP] ids as the example's test feeds them
    inputs = [
        [101, 12, 54, 33, 7, 88, 19, 42, 102],
        [101, 61, 23, 102],
        [101, 9, 77, 45, 31, 102],
    ]
    vec = model(inputs, [], [], kFirst, True)
    for i, v in enumerate(vec):
        print(f"sentence {i} pooled[:6]:", [round(float(x), 5) for x in v[:6]])


if __name__ == "__main__":
    main()
