"""HF BertModel (random weights from a BertConfig) on a padded batch of sentence pairs, attentions returned.

Follows huggingface/transformers src/transformers/models/bert/modeling_bert.py used the way
run_glue.py / a sentence-pair classifier calls it: input_ids, token_type_ids (0 = sentence A, 1 = sentence B),
attention_mask (1 = real, 0 = padding), output_attentions=True with attn_implementation="eager".
Mask meant: an encoder, so full bidirectional attention between all real tokens of both sentences
(sentence A sees sentence B and back); padding keys hidden. No causal mask: BERT is not autoregressive.
"""
import torch
from transformers import BertConfig, BertModel


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    model = BertModel(config, add_pooling_layer=True).eval()
    cls, sep, pad = 1, 2, config.pad_token_id
    pairs = [([10, 11, 12, 13], [20, 21, 22]), ([14, 15], [23, 24, 25, 26, 27]), ([16], [28])]
    max_len = max(len(a) + len(b) + 3 for a, b in pairs)
    input_ids, token_type_ids, attention_mask = [], [], []
    for a, b in pairs:
        ids = [cls] + a + [sep] + b + [sep]
        types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        n_pad = max_len - len(ids)
        input_ids.append(ids + [pad] * n_pad)
        token_type_ids.append(types + [0] * n_pad)
        attention_mask.append([1] * len(ids) + [0] * n_pad)
    with torch.no_grad():
        outputs = model(input_ids=torch.tensor(input_ids), token_type_ids=torch.tensor(token_type_ids),
                        attention_mask=torch.tensor(attention_mask), output_attentions=True)
    print("pooled", tuple(outputs.pooler_output.shape), "layers", len(outputs.attentions))


if __name__ == "__main__":
    main()
