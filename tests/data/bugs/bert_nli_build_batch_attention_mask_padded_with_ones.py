# yg211/bert_nli#3 (commit 8b356e7, "utils: Fix padding of attention masks"): utils/utils.py build_batch pads every
# sentence pair of a batch to the longest one, but extended each pair's attention mask with 1s, so the [PAD] positions
# of the shorter pairs were attended by BertNLIModel (its checkpointed encoder builds the -10000 extended mask from it).
# Fix: pad the attention mask with 0s.
import os
import sys
import tempfile

import numpy as np
import torch
from torch import nn
import torch.utils.checkpoint as checkpoint
from transformers import BertConfig, BertModel, BertTokenizer

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- utils/utils.py ----
def get_pair_input(tokenizer, sent1, sent2, model_type):
    if 'roberta' in model_type:
        text = "<s> {} </s></s> {} </s>".format(sent1, sent2)
    else:
        text = "[CLS] {} [SEP] {} [SEP]".format(sent1, sent2)

    tokenized_text = tokenizer.tokenize(text)
    indexed_tokens = tokenizer.encode(text)[1:-1]
    assert len(tokenized_text) == len(indexed_tokens)

    if len(tokenized_text) > 500:
        return None, None
    # Define sentence A and B indices associated to 1st and 2nd sentences (see paper)
    segments_ids = []
    sep_flag = False
    for i in range(len(indexed_tokens)):
        if 'roberta' in model_type and tokenized_text[i] == '</s>' and not sep_flag:
            segments_ids.append(0)
            sep_flag = True
        elif 'bert-' in model_type and tokenized_text[i] == '[SEP]' and not sep_flag:
            segments_ids.append(0)
            sep_flag = True
        elif sep_flag:
            segments_ids.append(1)
        else:
            segments_ids.append(0)
    return indexed_tokens, segments_ids


def build_batch(tokenizer, text_list, model_type):
    token_id_list = []
    segment_list = []
    attention_masks = []
    longest = -1

    for pair in text_list:
        sent1, sent2 = pair
        ids, segs = get_pair_input(tokenizer, sent1, sent2, model_type)
        if ids is None or segs is None: continue
        token_id_list.append(ids)
        segment_list.append(segs)
        attention_masks.append([1] * len(ids))
        if len(ids) > longest: longest = len(ids)

    if len(token_id_list) == 0: return None, None, None

    # padding
    assert (len(token_id_list) == len(segment_list))
    for ii in range(len(token_id_list)):
        token_id_list[ii] += [0] * (longest - len(token_id_list[ii]))
        if FIXED:
            attention_masks[ii] += [0] * (longest - len(attention_masks[ii]))
        else:
            attention_masks[ii] += [1] * (longest - len(attention_masks[ii]))
        segment_list[ii] += [1] * (longest - len(segment_list[ii]))

    return token_id_list, segment_list, attention_masks


# ---- bert_nli.py ----
class BertNLIModel(nn.Module):
    """Performs prediction, given the input of BERT embeddings."""

    def __init__(self, bert, tokenizer, gpu=False, bert_type='bert-base', label_num=3, batch_size=8):
        super(BertNLIModel, self).__init__()
        self.bert_type = bert_type
        self.bert = bert  # BertModel.from_pretrained('bert-base-uncased') upstream; a tiny config here
        self.tokenizer = tokenizer
        self.num_hidden_layers = self.bert.config.num_hidden_layers
        self.vdim = self.bert.config.hidden_size
        self.nli_head = nn.Linear(self.vdim, label_num)
        self.gpu = gpu
        self.batch_size = batch_size
        self.sm = nn.Softmax(dim=1)

    def forward(self, sent_pair_list, checkpoint=True, bs=None):
        all_probs = None
        if bs is None:
            bs = self.batch_size
        for batch_idx in range(0, len(sent_pair_list), bs):
            probs = self.ff(sent_pair_list[batch_idx:batch_idx + bs], checkpoint)[1].data.cpu().numpy()
            if all_probs is None:
                all_probs = probs
            else:
                all_probs = np.append(all_probs, probs, axis=0)
        labels = []
        for pp in all_probs:
            ll = np.argmax(pp)
            if ll == 0:
                labels.append('contradiction')
            elif ll == 1:
                labels.append('entail')
            else:
                assert ll == 2
                labels.append('neutral')
        return labels, all_probs

    def step_bert_encode(self, module, hidden_states, attention_mask=None, head_mask=None):
        for i, layer_module in enumerate(module.layer):
            # BertLayer(hidden_states, attention_mask, head_mask) in transformers 2.x; the third slot is unused here
            layer_outputs = checkpoint.checkpoint(layer_module, hidden_states, attention_mask, head_mask[i],
                                                  use_reentrant=False)
            hidden_states = layer_outputs[0] if isinstance(layer_outputs, tuple) else layer_outputs
        outputs = (hidden_states,)
        return outputs  # last-layer hidden state

    def step_checkpoint_bert(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                             head_mask=None):
        modules = [module for k, module in self.bert._modules.items()]

        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        head_mask = [None] * self.num_hidden_layers

        embedding_output = modules[0](input_ids, position_ids=position_ids, token_type_ids=token_type_ids)
        encoder_outputs = self.step_bert_encode(modules[1], embedding_output, extended_attention_mask, head_mask)
        sequence_output = encoder_outputs[0]
        pooled_output = modules[2](sequence_output)

        outputs = (sequence_output, pooled_output,) + encoder_outputs[1:]
        return outputs  # sequence_output, pooled_output

    def ff(self, sent_pair_list, checkpoint):
        ids, types, masks = build_batch(self.tokenizer, sent_pair_list, self.bert_type)
        if ids is None: return None
        ids_tensor = torch.tensor(ids)
        types_tensor = torch.tensor(types)
        masks_tensor = torch.tensor(masks)

        if checkpoint:
            cls_vecs = self.step_checkpoint_bert(input_ids=ids_tensor, token_type_ids=types_tensor,
                                                 attention_mask=masks_tensor)[1]
        else:
            cls_vecs = self.bert(input_ids=ids_tensor, token_type_ids=types_tensor, attention_mask=masks_tensor)[1]

        logits = self.nli_head(cls_vecs)
        probs = self.sm(logits)
        return logits, probs


def make_tokenizer(words):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    d = tempfile.mkdtemp()
    path = os.path.join(d, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizer(path, do_lower_case=True)


def main():
    pairs = [
        ("a man is playing a guitar on the stage tonight", "a person plays music for a large crowd"),
        ("a dog runs", "an animal moves"),
        ("two kids are eating", "nobody is eating lunch at the park"),
        ("the cat sleeps", "a cat is awake"),
    ]
    words = sorted({w for p in pairs for s in p for w in s.split()})
    tokenizer = make_tokenizer(words)
    config = BertConfig(vocab_size=len(words) + 5, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertNLIModel(BertModel(config, add_pooling_layer=True), tokenizer, gpu=False, bert_type='bert-base',
                         batch_size=4)
    model.eval()
    with torch.no_grad():
        labels, probs = model(pairs)
    for pair, lab, pr in zip(pairs, labels, probs):
        print(lab, np.round(pr, 5), "|", pair[0], "||", pair[1])


if __name__ == "__main__":
    main()
