# Citation: lonePatient/BERT-NER-Pytorch @7c938a2ded28d8d379fef1879e07da08df5a1eb8:
#   models/bert_for_ner.py (BertCrfForNer), models/layers/crf.py (CRF: forward / _compute_score /
#   _compute_normalizer / _viterbi_decode), processors/ner_seq.py (convert_examples_to_features, collate_fn),
#   run_ner_crf.py (evaluate: inputs = {input_ids, attention_mask, labels}, model.crf.decode(logits, attention_mask)).
# Token classification (NER) with a BERT encoder and a linear-chain CRF. Features are right-padded to
# max_seq_length with input_mask 0 (label 0 = "X" on the pads); collate_fn trims the batch to its longest
# input_len; BertModel gets attention_mask, and the same attention_mask is the CRF's mask: the CRF adds a
# transition / emission only where mask[i] == 1, ends each sequence at mask.sum() - 1, and Viterbi writes
# pad_tag 0 past the end. Checked: logits at real tokens against each sentence run alone (no padding, no
# mask), the CRF log-likelihood against a brute-force sum over every tag path of each sentence alone, and
# the decoded tags against the brute-force best path.
import itertools
import os
import tempfile
from typing import List, Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset
from transformers import BertConfig, BertModel, BertPreTrainedModel, BertTokenizer

torch.manual_seed(0)


# ---- models/layers/crf.py -------------------------------------------------------------------------
class CRF(nn.Module):
    def __init__(self, num_tags: int, batch_first: bool = False) -> None:
        if num_tags <= 0:
            raise ValueError(f'invalid number of tags: {num_tags}')
        super().__init__()
        self.num_tags = num_tags
        self.batch_first = batch_first
        self.start_transitions = nn.Parameter(torch.empty(num_tags))
        self.end_transitions = nn.Parameter(torch.empty(num_tags))
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.start_transitions, -0.1, 0.1)
        nn.init.uniform_(self.end_transitions, -0.1, 0.1)
        nn.init.uniform_(self.transitions, -0.1, 0.1)

    def forward(self, emissions, tags, mask=None, reduction='mean'):
        if reduction not in ('none', 'sum', 'mean', 'token_mean'):
            raise ValueError(f'invalid reduction: {reduction}')
        if mask is None:
            mask = torch.ones_like(tags, dtype=torch.uint8, device=tags.device)
        if mask.dtype != torch.uint8:
            mask = mask.byte()
        self._validate(emissions, tags=tags, mask=mask)

        if self.batch_first:
            emissions = emissions.transpose(0, 1)
            tags = tags.transpose(0, 1)
            mask = mask.transpose(0, 1)

        numerator = self._compute_score(emissions, tags, mask)
        denominator = self._compute_normalizer(emissions, mask)
        llh = numerator - denominator

        if reduction == 'none':
            return llh
        if reduction == 'sum':
            return llh.sum()
        if reduction == 'mean':
            return llh.mean()
        return llh.sum() / mask.float().sum()

    def decode(self, emissions, mask=None, nbest: Optional[int] = None, pad_tag: Optional[int] = None):
        if nbest is None:
            nbest = 1
        if mask is None:
            mask = torch.ones(emissions.shape[:2], dtype=torch.uint8, device=emissions.device)
        if mask.dtype != torch.uint8:
            mask = mask.byte()
        self._validate(emissions, mask=mask)

        if self.batch_first:
            emissions = emissions.transpose(0, 1)
            mask = mask.transpose(0, 1)

        if nbest == 1:
            return self._viterbi_decode(emissions, mask, pad_tag).unsqueeze(0)
        raise NotImplementedError

    def _validate(self, emissions, tags=None, mask=None) -> None:
        if emissions.dim() != 3:
            raise ValueError(f'emissions must have dimension of 3, got {emissions.dim()}')
        if emissions.size(2) != self.num_tags:
            raise ValueError(f'expected last dimension of emissions is {self.num_tags}, got {emissions.size(2)}')
        if tags is not None:
            if emissions.shape[:2] != tags.shape:
                raise ValueError('the first two dimensions of emissions and tags must match')
        if mask is not None:
            if emissions.shape[:2] != mask.shape:
                raise ValueError('the first two dimensions of emissions and mask must match')
            no_empty_seq = not self.batch_first and mask[0].all()
            no_empty_seq_bf = self.batch_first and mask[:, 0].all()
            if not no_empty_seq and not no_empty_seq_bf:
                raise ValueError('mask of the first timestep must all be on')

    def _compute_score(self, emissions, tags, mask):
        seq_length, batch_size = tags.shape
        mask = mask.float()
        score = self.start_transitions[tags[0]]
        score += emissions[0, torch.arange(batch_size), tags[0]]
        for i in range(1, seq_length):
            score += self.transitions[tags[i - 1], tags[i]] * mask[i]
            score += emissions[i, torch.arange(batch_size), tags[i]] * mask[i]
        seq_ends = mask.long().sum(dim=0) - 1
        last_tags = tags[seq_ends, torch.arange(batch_size)]
        score += self.end_transitions[last_tags]
        return score

    def _compute_normalizer(self, emissions, mask):
        seq_length = emissions.size(0)
        score = self.start_transitions + emissions[0]
        for i in range(1, seq_length):
            broadcast_score = score.unsqueeze(2)
            broadcast_emissions = emissions[i].unsqueeze(1)
            next_score = broadcast_score + self.transitions + broadcast_emissions
            next_score = torch.logsumexp(next_score, dim=1)
            score = torch.where(mask[i].unsqueeze(1).bool(), next_score, score)
        score += self.end_transitions
        return torch.logsumexp(score, dim=1)

    def _viterbi_decode(self, emissions, mask, pad_tag=None):
        if pad_tag is None:
            pad_tag = 0
        device = emissions.device
        seq_length, batch_size = mask.shape
        score = self.start_transitions + emissions[0]
        history_idx = torch.zeros((seq_length, batch_size, self.num_tags), dtype=torch.long, device=device)
        oor_idx = torch.zeros((batch_size, self.num_tags), dtype=torch.long, device=device)
        oor_tag = torch.full((seq_length, batch_size), pad_tag, dtype=torch.long, device=device)
        for i in range(1, seq_length):
            broadcast_score = score.unsqueeze(2)
            broadcast_emission = emissions[i].unsqueeze(1)
            next_score = broadcast_score + self.transitions + broadcast_emission
            next_score, indices = next_score.max(dim=1)
            score = torch.where(mask[i].unsqueeze(-1).bool(), next_score, score)
            indices = torch.where(mask[i].unsqueeze(-1).bool(), indices, oor_idx)
            history_idx[i - 1] = indices
        end_score = score + self.end_transitions
        _, end_tag = end_score.max(dim=1)
        seq_ends = mask.long().sum(dim=0) - 1
        history_idx = history_idx.transpose(1, 0).contiguous()
        history_idx.scatter_(1, seq_ends.view(-1, 1, 1).expand(-1, 1, self.num_tags),
                             end_tag.view(-1, 1, 1).expand(-1, 1, self.num_tags))
        history_idx = history_idx.transpose(1, 0).contiguous()
        best_tags_arr = torch.zeros((seq_length, batch_size), dtype=torch.long, device=device)
        best_tags = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        for idx in range(seq_length - 1, -1, -1):
            best_tags = torch.gather(history_idx[idx], 1, best_tags)
            best_tags_arr[idx] = best_tags.data.view(batch_size)
        return torch.where(mask.bool(), best_tags_arr, oor_tag).transpose(0, 1)


# ---- models/bert_for_ner.py -----------------------------------------------------------------------
class BertCrfForNer(BertPreTrainedModel):
    def __init__(self, config):
        super(BertCrfForNer, self).__init__(config)
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.crf = CRF(num_tags=config.num_labels, batch_first=True)
        self.post_init()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        outputs = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        sequence_output = outputs[0]
        sequence_output = self.dropout(sequence_output)
        logits = self.classifier(sequence_output)
        outputs = (logits,)
        if labels is not None:
            loss = self.crf(emissions=logits, tags=labels, mask=attention_mask)
            outputs = (-1 * loss,) + outputs
        return outputs  # (loss), scores


# ---- processors/ner_seq.py ------------------------------------------------------------------------
class InputExample(object):
    def __init__(self, guid, text_a, labels):
        self.guid = guid
        self.text_a = text_a
        self.labels = labels


class InputFeatures(object):
    def __init__(self, input_ids, input_mask, input_len, segment_ids, label_ids):
        self.input_ids = input_ids
        self.input_mask = input_mask
        self.segment_ids = segment_ids
        self.label_ids = label_ids
        self.input_len = input_len


def collate_fn(batch):
    all_input_ids, all_attention_mask, all_token_type_ids, all_lens, all_labels = map(torch.stack, zip(*batch))
    max_len = max(all_lens).item()
    all_input_ids = all_input_ids[:, :max_len]
    all_attention_mask = all_attention_mask[:, :max_len]
    all_token_type_ids = all_token_type_ids[:, :max_len]
    all_labels = all_labels[:, :max_len]
    return all_input_ids, all_attention_mask, all_token_type_ids, all_labels, all_lens


def convert_examples_to_features(examples, label_list, max_seq_length, tokenizer,
                                 cls_token_at_end=False, cls_token="[CLS]", cls_token_segment_id=1,
                                 sep_token="[SEP]", pad_on_left=False, pad_token=0, pad_token_segment_id=0,
                                 sequence_a_segment_id=0, mask_padding_with_zero=True,):
    label_map = {label: i for i, label in enumerate(label_list)}
    features = []
    for (ex_index, example) in enumerate(examples):
        if isinstance(example.text_a, list):
            example.text_a = " ".join(example.text_a)
        tokens = tokenizer.tokenize(example.text_a)
        label_ids = [label_map[x] for x in example.labels]
        special_tokens_count = 2
        if len(tokens) > max_seq_length - special_tokens_count:
            tokens = tokens[: (max_seq_length - special_tokens_count)]
            label_ids = label_ids[: (max_seq_length - special_tokens_count)]
        tokens += [sep_token]
        label_ids += [label_map['O']]
        segment_ids = [sequence_a_segment_id] * len(tokens)
        if cls_token_at_end:
            tokens += [cls_token]
            label_ids += [label_map['O']]
            segment_ids += [cls_token_segment_id]
        else:
            tokens = [cls_token] + tokens
            label_ids = [label_map['O']] + label_ids
            segment_ids = [cls_token_segment_id] + segment_ids
        input_ids = tokenizer.convert_tokens_to_ids(tokens)
        input_mask = [1 if mask_padding_with_zero else 0] * len(input_ids)
        input_len = len(label_ids)
        padding_length = max_seq_length - len(input_ids)
        if pad_on_left:
            input_ids = ([pad_token] * padding_length) + input_ids
            input_mask = ([0 if mask_padding_with_zero else 1] * padding_length) + input_mask
            segment_ids = ([pad_token_segment_id] * padding_length) + segment_ids
            label_ids = ([pad_token] * padding_length) + label_ids
        else:
            input_ids += [pad_token] * padding_length
            input_mask += [0 if mask_padding_with_zero else 1] * padding_length
            segment_ids += [pad_token_segment_id] * padding_length
            label_ids += [pad_token] * padding_length
        assert len(input_ids) == max_seq_length
        assert len(input_mask) == max_seq_length
        assert len(segment_ids) == max_seq_length
        assert len(label_ids) == max_seq_length
        features.append(InputFeatures(input_ids=input_ids, input_mask=input_mask, input_len=input_len,
                                      segment_ids=segment_ids, label_ids=label_ids))
    return features


# ---- a tiny character vocabulary (the CNER data is character-level) --------------------------------
chars = list("abcdefghijklmnopqrstuvwxyz")
vocab_dir = tempfile.mkdtemp()
with open(os.path.join(vocab_dir, "vocab.txt"), "w") as f:
    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars) + "\n")
tokenizer = BertTokenizer(os.path.join(vocab_dir, "vocab.txt"), do_lower_case=True)

label_list = ["X", "B-NAME", "I-NAME", "O", "S-ORG"]
id2label = {i: label for i, label in enumerate(label_list)}

sentences = [
    (list("zhang"), ["B-NAME", "I-NAME", "O", "S-ORG", "O"]),
    (list("li"), ["B-NAME", "I-NAME"]),
    (list("wang"), ["O", "B-NAME", "I-NAME", "O"]),
    (list("qin"), ["S-ORG", "O", "O"]),
]
examples = [InputExample(guid=f"train-{i}", text_a=t, labels=l) for i, (t, l) in enumerate(sentences)]
max_seq_length = 12
features = convert_examples_to_features(
    examples=examples, tokenizer=tokenizer, label_list=label_list, max_seq_length=max_seq_length,
    cls_token_at_end=False, pad_on_left=False, cls_token=tokenizer.cls_token, cls_token_segment_id=0,
    sep_token=tokenizer.sep_token, pad_token=tokenizer.convert_tokens_to_ids([tokenizer.pad_token])[0],
    pad_token_segment_id=0,
)
all_input_ids = torch.tensor([f.input_ids for f in features], dtype=torch.long)
all_input_mask = torch.tensor([f.input_mask for f in features], dtype=torch.long)
all_segment_ids = torch.tensor([f.segment_ids for f in features], dtype=torch.long)
all_label_ids = torch.tensor([f.label_ids for f in features], dtype=torch.long)
all_lens = torch.tensor([f.input_len for f in features], dtype=torch.long)
dataset = TensorDataset(all_input_ids, all_input_mask, all_segment_ids, all_lens, all_label_ids)
dataloader = DataLoader(dataset, sampler=SequentialSampler(dataset), batch_size=4, collate_fn=collate_fn)

config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32, num_labels=len(label_list),
                    initializer_range=0.2)
config._attn_implementation = "eager"
model = BertCrfForNer(config)
with torch.no_grad():
    model.crf.transitions.uniform_(-1.0, 1.0)
    model.crf.start_transitions.uniform_(-1.0, 1.0)
    model.crf.end_transitions.uniform_(-1.0, 1.0)
model.eval()

# ---- run_ner_crf.py evaluate -------------------------------------------------------------------------
for step, batch in enumerate(dataloader):
    with torch.no_grad():
        inputs = {"input_ids": batch[0], "attention_mask": batch[1], "labels": batch[3]}
        inputs["token_type_ids"] = batch[2]
        outputs = model(**inputs)
        tmp_eval_loss, logits = outputs[:2]
        tags = model.crf.decode(logits, inputs['attention_mask'])
        llh_rows = model.crf(emissions=logits, tags=inputs["labels"], mask=inputs["attention_mask"],
                             reduction="none")
    input_lens = batch[4].tolist()
    tags = tags.squeeze(0)
    assert logits.shape[1] == max(input_lens) < max_seq_length

    # ---- reference: each sentence alone, no padding, and a brute-force CRF --------------------------
    crf = model.crf
    ref_llh = []
    for i, n in enumerate(input_lens):
        with torch.no_grad():
            alone = model(input_ids=batch[0][i:i + 1, :n], token_type_ids=batch[2][i:i + 1, :n])[0][0]
        torch.testing.assert_close(logits[i, :n], alone, rtol=1e-5, atol=1e-5)

        paths = torch.tensor(list(itertools.product(range(len(label_list)), repeat=n)))  # (P, n)
        with torch.no_grad():
            s = crf.start_transitions[paths[:, 0]] + crf.end_transitions[paths[:, -1]]
            for t in range(n):
                s = s + alone[t, paths[:, t]]
            for t in range(1, n):
                s = s + crf.transitions[paths[:, t - 1], paths[:, t]]
        gold = batch[3][i, :n]
        gold_index = int(sum(int(g) * len(label_list) ** (n - 1 - t) for t, g in enumerate(gold)))
        assert torch.equal(paths[gold_index], gold)
        ref_llh.append(s[gold_index] - torch.logsumexp(s, dim=0))
        best = paths[s.argmax()]
        assert torch.equal(tags[i, :n], best), (i, tags[i], best)
        assert (tags[i, n:] == 0).all()
    ref_llh = torch.stack(ref_llh)
    torch.testing.assert_close(llh_rows, ref_llh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tmp_eval_loss, -ref_llh.mean(), rtol=1e-5, atol=1e-5)
    pred = [[id2label[t] for t in tags[i, 1:n - 1].tolist()] for i, n in enumerate(input_lens)]
    print("loss", round(tmp_eval_loss.item(), 4), "pred", pred)

print("ok: logits match each sentence alone; CRF llh and Viterbi tags match a brute force over tag paths")
