# Follows microsoft/unilm layoutlm/deprecated (commit 40fbc437f2f903522a731da1a2690a0eb69f3c10):
#   layoutlm/modeling/layoutlm.py (LayoutlmConfig, LayoutlmEmbeddings, LayoutlmModel.forward,
#   LayoutlmForTokenClassification.forward), layoutlm/data/funsd.py (convert_examples_to_features, FunsdDataset)
#   and examples/seq_labeling/run_seq_labeling.py (train / evaluate, pad_token_label_id = CrossEntropyLoss().ignore_index).
# The BERT encoder LayoutlmModel inherits (transformers 2.x BertEncoder) is written out in plain torch.
# FUNSD pages of different lengths are word-piece tokenized, [CLS] ... [SEP] framed and right padded to
# max_seq_length (pad id 0, box [0,0,0,0], input_mask 0, label -100); LayoutlmModel turns input_mask into a
# (1 - mask) * -10000 bias over keys, the token-classification loss keeps only input_mask == 1 positions, and
# evaluate() reads predictions only where the label is not pad_token_label_id (first word-piece of each word).
# Checked: batched logits on real tokens, loss, gradients and preds_list equal each page run alone, unpadded.
import math
import os
import tempfile

import numpy as np
import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import BertConfig, BertTokenizer

BertLayerNorm = torch.nn.LayerNorm


class LayoutlmConfig(BertConfig):
    model_type = "bert"

    def __init__(self, max_2d_position_embeddings=1024, **kwargs):
        super().__init__(**kwargs)
        self.max_2d_position_embeddings = max_2d_position_embeddings


class LayoutlmEmbeddings(nn.Module):
    def __init__(self, config):
        super(LayoutlmEmbeddings, self).__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.x_position_embeddings = nn.Embedding(config.max_2d_position_embeddings, config.hidden_size)
        self.y_position_embeddings = nn.Embedding(config.max_2d_position_embeddings, config.hidden_size)
        self.h_position_embeddings = nn.Embedding(config.max_2d_position_embeddings, config.hidden_size)
        self.w_position_embeddings = nn.Embedding(config.max_2d_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, bbox, token_type_ids=None, position_ids=None, inputs_embeds=None):
        seq_length = input_ids.size(1)
        if position_ids is None:
            position_ids = torch.arange(seq_length, dtype=torch.long, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        words_embeddings = self.word_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids)
        left_position_embeddings = self.x_position_embeddings(bbox[:, :, 0])
        upper_position_embeddings = self.y_position_embeddings(bbox[:, :, 1])
        right_position_embeddings = self.x_position_embeddings(bbox[:, :, 2])
        lower_position_embeddings = self.y_position_embeddings(bbox[:, :, 3])
        h_position_embeddings = self.h_position_embeddings(bbox[:, :, 3] - bbox[:, :, 1])
        w_position_embeddings = self.w_position_embeddings(bbox[:, :, 2] - bbox[:, :, 0])
        token_type_embeddings = self.token_type_embeddings(token_type_ids)

        embeddings = (
            words_embeddings
            + position_embeddings
            + left_position_embeddings
            + upper_position_embeddings
            + right_position_embeddings
            + lower_position_embeddings
            + h_position_embeddings
            + w_position_embeddings
            + token_type_embeddings
        )
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


# ---- transformers 2.x modeling_bert.py encoder (what LayoutlmModel(BertModel) runs) ----
class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)
        if head_mask is not None:
            attention_probs = attention_probs * head_mask

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.attn_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn_LayerNorm = BertLayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, head_mask=None):
        self_outputs = self.self(hidden_states, attention_mask, head_mask)
        attention_output = self.attn_LayerNorm(self.dropout(self.attn_dense(self_outputs)) + hidden_states)
        intermediate_output = nn.functional.gelu(self.intermediate(attention_output))
        return self.LayerNorm(self.dropout(self.output(intermediate_output)) + attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None, head_mask=None):
        for i, layer_module in enumerate(self.layer):
            hidden_states = layer_module(hidden_states, attention_mask, head_mask[i])
        return (hidden_states,)


class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


class LayoutlmModel(nn.Module):
    def __init__(self, config):
        super(LayoutlmModel, self).__init__()
        self.config = config
        self.embeddings = LayoutlmEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(self, input_ids, bbox, attention_mask=None, token_type_ids=None, position_ids=None,
                head_mask=None, inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        # We create a 3D attention mask from a 2D tensor mask.
        # Sizes are [batch_size, 1, 1, to_seq_length]
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        if head_mask is not None:
            raise NotImplementedError("head_mask is not used by run_seq_labeling.py")
        head_mask = [None] * self.config.num_hidden_layers

        embedding_output = self.embeddings(input_ids, bbox, position_ids=position_ids, token_type_ids=token_type_ids)
        encoder_outputs = self.encoder(embedding_output, extended_attention_mask, head_mask=head_mask)
        sequence_output = encoder_outputs[0]
        pooled_output = self.pooler(sequence_output)
        outputs = (sequence_output, pooled_output) + encoder_outputs[1:]
        return outputs  # sequence_output, pooled_output, (hidden_states), (attentions)


class LayoutlmForTokenClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_labels = config.num_labels
        self.bert = LayoutlmModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, bbox, attention_mask=None, token_type_ids=None, position_ids=None,
                head_mask=None, inputs_embeds=None, labels=None):
        outputs = self.bert(input_ids=input_ids, bbox=bbox, attention_mask=attention_mask,
                            token_type_ids=token_type_ids, position_ids=position_ids, head_mask=head_mask)
        sequence_output = outputs[0]
        sequence_output = self.dropout(sequence_output)
        logits = self.classifier(sequence_output)

        outputs = (logits,) + outputs[2:]  # add hidden states and attention if they are here
        if labels is not None:
            loss_fct = CrossEntropyLoss()
            # Only keep active parts of the loss
            if attention_mask is not None:
                active_loss = attention_mask.view(-1) == 1
                active_logits = logits.view(-1, self.num_labels)[active_loss]
                active_labels = labels.view(-1)[active_loss]
                loss = loss_fct(active_logits, active_labels)
            else:
                loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
            outputs = (loss,) + outputs
        return outputs  # (loss), scores, (hidden_states), (attentions)


# ---- layoutlm/data/funsd.py (FunsdDataset keeps these five tensors: input_ids, input_mask, segment_ids, label_ids, bboxes) ----
class InputExample(object):
    def __init__(self, guid, words, labels, boxes, actual_bboxes, file_name, page_size):
        self.guid = guid
        self.words = words
        self.labels = labels
        self.boxes = boxes
        self.actual_bboxes = actual_bboxes
        self.file_name = file_name
        self.page_size = page_size


def convert_examples_to_features(examples, label_list, max_seq_length, tokenizer, cls_token_at_end=False,
                                 cls_token="[CLS]", cls_token_segment_id=1, sep_token="[SEP]", sep_token_extra=False,
                                 pad_on_left=False, pad_token=0, cls_token_box=[0, 0, 0, 0],
                                 sep_token_box=[1000, 1000, 1000, 1000], pad_token_box=[0, 0, 0, 0],
                                 pad_token_segment_id=0, pad_token_label_id=-1, sequence_a_segment_id=0,
                                 mask_padding_with_zero=True):
    label_map = {label: i for i, label in enumerate(label_list)}
    features = []
    for (ex_index, example) in enumerate(examples):
        width, height = example.page_size
        tokens = []
        token_boxes = []
        actual_bboxes = []
        label_ids = []
        for word, label, box, actual_bbox in zip(example.words, example.labels, example.boxes, example.actual_bboxes):
            word_tokens = tokenizer.tokenize(word)
            tokens.extend(word_tokens)
            token_boxes.extend([box] * len(word_tokens))
            actual_bboxes.extend([actual_bbox] * len(word_tokens))
            # Use the real label id for the first token of the word, and padding ids for the remaining tokens
            label_ids.extend([label_map[label]] + [pad_token_label_id] * (len(word_tokens) - 1))

        # Account for [CLS] and [SEP] with "- 2" and with "- 3" for RoBERTa.
        special_tokens_count = 3 if sep_token_extra else 2
        if len(tokens) > max_seq_length - special_tokens_count:
            tokens = tokens[: (max_seq_length - special_tokens_count)]
            token_boxes = token_boxes[: (max_seq_length - special_tokens_count)]
            actual_bboxes = actual_bboxes[: (max_seq_length - special_tokens_count)]
            label_ids = label_ids[: (max_seq_length - special_tokens_count)]

        tokens += [sep_token]
        token_boxes += [sep_token_box]
        actual_bboxes += [[0, 0, width, height]]
        label_ids += [pad_token_label_id]
        segment_ids = [sequence_a_segment_id] * len(tokens)

        tokens = [cls_token] + tokens
        token_boxes = [cls_token_box] + token_boxes
        actual_bboxes = [[0, 0, width, height]] + actual_bboxes
        label_ids = [pad_token_label_id] + label_ids
        segment_ids = [cls_token_segment_id] + segment_ids

        input_ids = tokenizer.convert_tokens_to_ids(tokens)

        # The mask has 1 for real tokens and 0 for padding tokens. Only real tokens are attended to.
        input_mask = [1 if mask_padding_with_zero else 0] * len(input_ids)

        # Zero-pad up to the sequence length.
        padding_length = max_seq_length - len(input_ids)
        input_ids += [pad_token] * padding_length
        input_mask += [0 if mask_padding_with_zero else 1] * padding_length
        segment_ids += [pad_token_segment_id] * padding_length
        label_ids += [pad_token_label_id] * padding_length
        token_boxes += [pad_token_box] * padding_length

        assert len(input_ids) == max_seq_length
        assert len(input_mask) == max_seq_length
        features.append((input_ids, input_mask, segment_ids, label_ids, token_boxes))
    return features


def funsd_dataset_tensors(examples, tokenizer, labels, pad_token_label_id, max_seq_length):
    features = convert_examples_to_features(
        examples, labels, max_seq_length, tokenizer,
        cls_token_at_end=False, cls_token=tokenizer.cls_token, cls_token_segment_id=0,
        sep_token=tokenizer.sep_token, sep_token_extra=False, pad_on_left=False,
        pad_token=tokenizer.convert_tokens_to_ids([tokenizer.pad_token])[0],
        pad_token_segment_id=0, pad_token_label_id=pad_token_label_id,
    )
    return [torch.tensor([f[k] for f in features], dtype=torch.long) for k in range(5)]


# ---- a tiny FUNSD-like set of form pages (OCR words, normalized 0..1000 boxes, BIO labels) ----
LABELS = ["O", "B-HEADER", "I-HEADER", "B-QUESTION", "I-QUESTION", "B-ANSWER", "I-ANSWER"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "invoice", "date", ":", "total", "amount", "due", "name",
         "address", "fax", "to", "from", "re", "page", "of", "tel", "12", "##50", "##3", "2019", "-", "smith",
         "##son", "lor", "##illard", "tobacco", "company", "research", "report", "approval", "sign", "##ed", "by",
         "march", "no", ".", "45", "##0", "3", "st", "new", "york"]
PAGES = [
    ("LORILLARD TOBACCO COMPANY RESEARCH REPORT Date: March 2019 Signed by: Smithson",
     ["B-HEADER", "I-HEADER", "I-HEADER", "I-HEADER", "I-HEADER", "B-QUESTION", "B-ANSWER", "I-ANSWER",
      "B-QUESTION", "I-QUESTION", "B-ANSWER"]),
    ("Fax: 1250 Page 3",
     ["B-QUESTION", "B-ANSWER", "B-QUESTION", "B-ANSWER"]),
    ("INVOICE No. 4503 Name: Smith Address: 450 New York St. Total amount due: 1250",
     ["B-HEADER", "B-QUESTION", "B-ANSWER", "B-QUESTION", "B-ANSWER", "B-QUESTION", "B-ANSWER", "I-ANSWER",
      "I-ANSWER", "I-ANSWER", "B-QUESTION", "I-QUESTION", "I-QUESTION", "B-ANSWER"]),
    ("To: Smithson From: Lorillard Re: approval",
     ["B-QUESTION", "B-ANSWER", "B-QUESTION", "B-ANSWER", "B-QUESTION", "O"]),
]


def make_examples(rng):
    examples = []
    for guid, (text, labels) in enumerate(PAGES):
        words = text.split()
        width, height = 762, 1000
        actual, boxes = [], []
        x, y = 40, 30
        for w in words:
            x1 = x + 9 * len(w)
            if x1 > width - 20:
                x, y = 40, y + int(rng.integers(25, 60))
                x1 = x + 9 * len(w)
            actual.append([x, y, x1, y + 14])
            x = x1 + int(rng.integers(6, 30))
        for b in actual:  # funsd.py normalize_box
            boxes.append([int(1000 * (b[0] / width)), int(1000 * (b[1] / height)),
                          int(1000 * (b[2] / width)), int(1000 * (b[3] / height))])
        examples.append(InputExample("test-%d" % guid, words, labels, boxes, actual, "page%d.png" % guid,
                                     (width, height)))
    return examples


def evaluate_preds(logits, out_label_ids, pad_token_label_id):
    preds = np.argmax(logits, axis=2)
    label_map = {i: label for i, label in enumerate(LABELS)}
    preds_list = [[] for _ in range(out_label_ids.shape[0])]
    for i in range(out_label_ids.shape[0]):
        for j in range(out_label_ids.shape[1]):
            if out_label_ids[i, j] != pad_token_label_id:
                preds_list[i].append(label_map[preds[i][j]])
    return preds_list


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    tokenizer = BertTokenizer(os.path.join(tmp, "vocab.txt"), do_lower_case=True)

    pad_token_label_id = CrossEntropyLoss().ignore_index
    max_seq_length = 40
    examples = make_examples(rng)
    input_ids, input_mask, segment_ids, label_ids, bboxes = funsd_dataset_tensors(
        examples, tokenizer, LABELS, pad_token_label_id, max_seq_length)
    lengths = input_mask.sum(1).tolist()
    print("real tokens per page:", lengths, "padded to", max_seq_length)

    config = LayoutlmConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, max_2d_position_embeddings=1024,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=len(LABELS))
    model = LayoutlmForTokenClassification(config).double()

    # run_seq_labeling.py train(): one step over the padded batch
    model.train()
    inputs = {"input_ids": input_ids, "attention_mask": input_mask, "labels": label_ids,
              "bbox": bboxes, "token_type_ids": segment_ids}
    loss, logits = model(**inputs)[:2]
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # reference: every page alone, no padding at all; the loss is the mean over all labelled word-pieces
    ce_sum, n_labelled, ref_logits = 0.0, 0, []
    model.zero_grad()
    for i, n in enumerate(lengths):
        out = model(input_ids=input_ids[i:i + 1, :n], bbox=bboxes[i:i + 1, :n],
                    token_type_ids=segment_ids[i:i + 1, :n])[0]
        lab = label_ids[i, :n]
        ce_sum = ce_sum + nn.functional.cross_entropy(out[0], lab, reduction="sum")
        n_labelled += int((lab != pad_token_label_id).sum())
        ref_logits.append(out[0])
    ref_loss = ce_sum / n_labelled
    ref_loss.backward()

    logit_err = max((logits[i, :n] - ref_logits[i]).abs().max().item() for i, n in enumerate(lengths))
    loss_err = abs(loss.item() - ref_loss.item())
    grad_err = max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters() if n in grads)
    print("train loss %.6f  vs pages alone: logits %.2e  loss %.2e  grads %.2e" % (loss.item(), logit_err,
                                                                                   loss_err, grad_err))
    assert logit_err < 1e-10 and loss_err < 1e-12 and grad_err < 1e-10

    # run_seq_labeling.py evaluate(): predictions read back only where a word starts
    model.eval()
    with torch.no_grad():
        eval_logits = model(**inputs)[1].numpy()
        preds_list = evaluate_preds(eval_logits, label_ids.numpy(), pad_token_label_id)
        for i, (n, ex) in enumerate(zip(lengths, examples)):
            alone = model(input_ids=input_ids[i:i + 1, :n], bbox=bboxes[i:i + 1, :n],
                          token_type_ids=segment_ids[i:i + 1, :n])[0].numpy()
            alone_preds = evaluate_preds(alone, label_ids[i:i + 1, :n].numpy(), pad_token_label_id)[0]
            assert len(preds_list[i]) == len(ex.words)
            assert preds_list[i] == alone_preds, (i, preds_list[i], alone_preds)
            assert np.abs(eval_logits[i, :n] - alone).max() < 1e-10
    print("evaluate(): one prediction per word on every page, equal to the page run alone")


if __name__ == "__main__":
    main()
