# Correct program (quiet batch quiet-r67b).
# Ported from princeton-nlp/SimCSE @49fa580a853752ede55b8c76d9debf748e214d3f (files last changed in
# 538785620e1fd3b1d2ac51413888210e915af1f8):
#   simcse/models.py (MLPLayer, Similarity, Pooler with 'cls' / 'cls_before_pooler' / 'avg' / 'avg_top2' /
#     'avg_first_last', cl_init, cl_forward with a hard negative (num_sent == 3), sentemb_forward, BertForCL,
#     RobertaForCL),
#   train.py (prepare_features: sent0 + sent1 + hard_neg tokenized with padding=False;
#     OurDataCollatorWithPadding: the features flattened to bs * num_sent rows, tokenizer.pad, viewed back
#     as (bs, num_sent, len)),
#   evaluation.py (batcher: batch_encode_plus(padding=True), the same poolers applied with batch['attention_mask']).
# Supervised SimCSE over (anchor, entailment, contradiction) triples: the three sentences of every example are padded
# together to the longest of the whole batch (right padding, RoBERTa's <pad> = 1, BERT's [PAD] = 0), the flattened
# (bs * 3, len) mask goes to the encoder and to the parameter-free pooler, which averages only real tokens (of the
# last layer, of the first + last, or of the top two layers). No tokenizer is downloaded: a word-level
# PreTrainedTokenizerFast is built in memory with the backbone's special tokens, and the backbones are tiny configs.
# Self-check: every sentence alone, unpadded and with no mask, through the same encoder; its pooled vector is the
# plain mean over its own tokens (or its first token for cls). The batch's pooled vectors, the cosine-similarity
# logits (with the hard-negative weight on the z1-z3 diagonal) and the cross-entropy loss are recomputed by a
# double loop over examples and must match; so must evaluation.py's batcher on a right-padded batch.
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Union

import torch
import torch.nn as nn
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast, RobertaConfig
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions, SequenceClassifierOutput
from transformers.models.bert.modeling_bert import BertModel, BertPreTrainedModel
from transformers.models.roberta.modeling_roberta import RobertaModel, RobertaPreTrainedModel

torch.manual_seed(0)


# --- simcse/models.py ---
class MLPLayer(nn.Module):
    """
    Head for getting sentence representations over RoBERTa/BERT's CLS representation.
    """

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, features, **kwargs):
        x = self.dense(features)
        x = self.activation(x)

        return x


class Similarity(nn.Module):
    """
    Dot product or cosine similarity
    """

    def __init__(self, temp):
        super().__init__()
        self.temp = temp
        self.cos = nn.CosineSimilarity(dim=-1)

    def forward(self, x, y):
        return self.cos(x, y) / self.temp


class Pooler(nn.Module):
    """
    Parameter-free poolers to get the sentence embedding
    'cls': [CLS] representation with BERT/RoBERTa's MLP pooler.
    'cls_before_pooler': [CLS] representation without the original MLP pooler.
    'avg': average of the last layers' hidden states at each token.
    'avg_top2': average of the last two layers.
    'avg_first_last': average of the first and the last layers.
    """
    def __init__(self, pooler_type):
        super().__init__()
        self.pooler_type = pooler_type
        assert self.pooler_type in ["cls", "cls_before_pooler", "avg", "avg_top2", "avg_first_last"], "unrecognized pooling type %s" % self.pooler_type

    def forward(self, attention_mask, outputs):
        last_hidden = outputs.last_hidden_state
        pooler_output = outputs.pooler_output
        hidden_states = outputs.hidden_states

        if self.pooler_type in ['cls_before_pooler', 'cls']:
            return last_hidden[:, 0]
        elif self.pooler_type == "avg":
            return ((last_hidden * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(-1).unsqueeze(-1))
        elif self.pooler_type == "avg_first_last":
            first_hidden = hidden_states[1]
            last_hidden = hidden_states[-1]
            pooled_result = ((first_hidden + last_hidden) / 2.0 * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(-1).unsqueeze(-1)
            return pooled_result
        elif self.pooler_type == "avg_top2":
            second_last_hidden = hidden_states[-2]
            last_hidden = hidden_states[-1]
            pooled_result = ((last_hidden + second_last_hidden) / 2.0 * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(-1).unsqueeze(-1)
            return pooled_result
        else:
            raise NotImplementedError


def cl_init(cls, config):
    """
    Contrastive learning class init function.
    """
    cls.pooler_type = cls.model_args.pooler_type
    cls.pooler = Pooler(cls.model_args.pooler_type)
    if cls.model_args.pooler_type == "cls":
        cls.mlp = MLPLayer(config)
    cls.sim = Similarity(temp=cls.model_args.temp)
    cls.post_init()  # cls.init_weights() in SimCSE (transformers 4.2); post_init() runs it in transformers 5


def cl_forward(cls,
    encoder,
    input_ids=None,
    attention_mask=None,
    token_type_ids=None,
    position_ids=None,
    head_mask=None,
    inputs_embeds=None,
    labels=None,
    output_attentions=None,
    output_hidden_states=None,
    return_dict=None,
    mlm_input_ids=None,
    mlm_labels=None,
):
    return_dict = return_dict if return_dict is not None else cls.config.use_return_dict
    ori_input_ids = input_ids
    batch_size = input_ids.size(0)
    # Number of sentences in one instance
    # 2: pair instance; 3: pair instance with a hard negative
    num_sent = input_ids.size(1)

    mlm_outputs = None
    # Flatten input for encoding
    input_ids = input_ids.view((-1, input_ids.size(-1))) # (bs * num_sent, len)
    attention_mask = attention_mask.view((-1, attention_mask.size(-1))) # (bs * num_sent len)
    if token_type_ids is not None:
        token_type_ids = token_type_ids.view((-1, token_type_ids.size(-1))) # (bs * num_sent, len)

    # Get raw embeddings
    outputs = encoder(
        input_ids,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        output_attentions=output_attentions,
        output_hidden_states=True if cls.model_args.pooler_type in ['avg_top2', 'avg_first_last'] else False,
        return_dict=True,
    )

    # Pooling
    pooler_output = cls.pooler(attention_mask, outputs)
    pooler_output = pooler_output.view((batch_size, num_sent, pooler_output.size(-1))) # (bs, num_sent, hidden)

    # If using "cls", we add an extra MLP layer
    # (same as BERT's original implementation) over the representation.
    if cls.pooler_type == "cls":
        pooler_output = cls.mlp(pooler_output)

    # Separate representation
    z1, z2 = pooler_output[:,0], pooler_output[:,1]

    # Hard negative
    if num_sent == 3:
        z3 = pooler_output[:, 2]

    # (single process: no all_gather)
    cos_sim = cls.sim(z1.unsqueeze(1), z2.unsqueeze(0))
    # Hard negative
    if num_sent >= 3:
        z1_z3_cos = cls.sim(z1.unsqueeze(1), z3.unsqueeze(0))
        cos_sim = torch.cat([cos_sim, z1_z3_cos], 1)

    labels = torch.arange(cos_sim.size(0)).long().to(cls.device)
    loss_fct = nn.CrossEntropyLoss()

    # Calculate loss with hard negatives
    if num_sent == 3:
        # Note that weights are actually logits of weights
        z3_weight = cls.model_args.hard_negative_weight
        weights = torch.tensor(
            [[0.0] * (cos_sim.size(-1) - z1_z3_cos.size(-1)) + [0.0] * i + [z3_weight] + [0.0] * (z1_z3_cos.size(-1) - i - 1) for i in range(z1_z3_cos.size(-1))]
        ).to(cls.device)
        cos_sim = cos_sim + weights

    loss = loss_fct(cos_sim, labels)

    if not return_dict:
        output = (cos_sim,) + outputs[2:]
        return ((loss,) + output) if loss is not None else output
    return SequenceClassifierOutput(
        loss=loss,
        logits=cos_sim,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    ), pooler_output  # the pooled (bs, num_sent, hidden) vectors returned beside it for the self-check


def sentemb_forward(
    cls,
    encoder,
    input_ids=None,
    attention_mask=None,
    token_type_ids=None,
    position_ids=None,
    head_mask=None,
    inputs_embeds=None,
    labels=None,
    output_attentions=None,
    output_hidden_states=None,
    return_dict=None,
):

    return_dict = return_dict if return_dict is not None else cls.config.use_return_dict

    outputs = encoder(
        input_ids,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        output_attentions=output_attentions,
        output_hidden_states=True if cls.pooler_type in ['avg_top2', 'avg_first_last'] else False,
        return_dict=True,
    )

    pooler_output = cls.pooler(attention_mask, outputs)
    if cls.pooler_type == "cls" and not cls.model_args.mlp_only_train:
        pooler_output = cls.mlp(pooler_output)

    if not return_dict:
        return (outputs[0], pooler_output) + outputs[2:]

    return BaseModelOutputWithPoolingAndCrossAttentions(
        pooler_output=pooler_output,
        last_hidden_state=outputs.last_hidden_state,
        hidden_states=outputs.hidden_states,
    )


class BertForCL(BertPreTrainedModel):
    _keys_to_ignore_on_load_missing = [r"position_ids"]

    def __init__(self, config, *model_args, **model_kargs):
        super().__init__(config)
        self.model_args = model_kargs["model_args"]
        self.bert = BertModel(config, add_pooling_layer=False)

        cl_init(self, config)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, sent_emb=False, mlm_input_ids=None, mlm_labels=None):
        if sent_emb:
            return sentemb_forward(self, self.bert, input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids, head_mask=head_mask,
                                   inputs_embeds=inputs_embeds, labels=labels, output_attentions=output_attentions,
                                   output_hidden_states=output_hidden_states, return_dict=return_dict)
        else:
            return cl_forward(self, self.bert, input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids, position_ids=position_ids, head_mask=head_mask,
                              inputs_embeds=inputs_embeds, labels=labels, output_attentions=output_attentions,
                              output_hidden_states=output_hidden_states, return_dict=return_dict,
                              mlm_input_ids=mlm_input_ids, mlm_labels=mlm_labels)


class RobertaForCL(RobertaPreTrainedModel):
    _keys_to_ignore_on_load_missing = [r"position_ids"]

    def __init__(self, config, *model_args, **model_kargs):
        super().__init__(config)
        self.model_args = model_kargs["model_args"]
        self.roberta = RobertaModel(config, add_pooling_layer=False)

        cl_init(self, config)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, sent_emb=False, mlm_input_ids=None, mlm_labels=None):
        if sent_emb:
            return sentemb_forward(self, self.roberta, input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids, head_mask=head_mask,
                                   inputs_embeds=inputs_embeds, labels=labels, output_attentions=output_attentions,
                                   output_hidden_states=output_hidden_states, return_dict=return_dict)
        else:
            return cl_forward(self, self.roberta, input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids, position_ids=position_ids, head_mask=head_mask,
                              inputs_embeds=inputs_embeds, labels=labels, output_attentions=output_attentions,
                              output_hidden_states=output_hidden_states, return_dict=return_dict,
                              mlm_input_ids=mlm_input_ids, mlm_labels=mlm_labels)


# --- train.py ---
def prepare_features(examples, tokenizer, data_args, sent0_cname="sent0", sent1_cname="sent1", sent2_cname="hard_neg"):
    # padding = longest (default)
    total = len(examples[sent0_cname])

    # Avoid "None" fields
    for idx in range(total):
        if examples[sent0_cname][idx] is None:
            examples[sent0_cname][idx] = " "
        if examples[sent1_cname][idx] is None:
            examples[sent1_cname][idx] = " "

    sentences = examples[sent0_cname] + examples[sent1_cname]

    # If hard negative exists
    if sent2_cname is not None:
        for idx in range(total):
            if examples[sent2_cname][idx] is None:
                examples[sent2_cname][idx] = " "
        sentences += examples[sent2_cname]

    sent_features = tokenizer(
        sentences,
        max_length=data_args.max_seq_length,
        truncation=True,
        padding="max_length" if data_args.pad_to_max_length else False,
    )

    features = {}
    if sent2_cname is not None:
        for key in sent_features:
            features[key] = [[sent_features[key][i], sent_features[key][i+total], sent_features[key][i+total*2]] for i in range(total)]
    else:
        for key in sent_features:
            features[key] = [[sent_features[key][i], sent_features[key][i+total]] for i in range(total)]

    return features


@dataclass
class OurDataCollatorWithPadding:

    tokenizer: PreTrainedTokenizerBase
    padding: Union[bool, str] = True
    max_length: Optional[int] = None
    pad_to_multiple_of: Optional[int] = None
    mlm: bool = False

    def __call__(self, features: List[Dict[str, Union[List[int], List[List[int]], torch.Tensor]]]) -> Dict[str, torch.Tensor]:
        special_keys = ['input_ids', 'attention_mask', 'token_type_ids', 'mlm_input_ids', 'mlm_labels']
        bs = len(features)
        if bs > 0:
            num_sent = len(features[0]['input_ids'])
        else:
            return
        flat_features = []
        for feature in features:
            for i in range(num_sent):
                flat_features.append({k: feature[k][i] if k in special_keys else feature[k] for k in feature})

        batch = self.tokenizer.pad(
            flat_features,
            padding=self.padding,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )

        batch = {k: batch[k].view(bs, num_sent, -1) if k in special_keys else batch[k].view(bs, num_sent, -1)[:, 0] for k in batch}

        if "label" in batch:
            batch["labels"] = batch["label"]
            del batch["label"]
        if "label_ids" in batch:
            batch["labels"] = batch["label_ids"]
            del batch["label_ids"]

        return batch


# --- evaluation.py (batcher, pooling part) ---
def batcher(model, tokenizer, pooler, sentences, max_length=None):
    # tokenizer.batch_encode_plus(...) in SimCSE; transformers 5 calls the tokenizer itself
    batch = tokenizer(sentences, return_tensors='pt', padding=True, max_length=max_length,
                      truncation=max_length is not None)
    with torch.no_grad():
        outputs = model(**batch, output_hidden_states=True, return_dict=True)
        last_hidden = outputs.last_hidden_state
        hidden_states = outputs.hidden_states

    if pooler == 'cls_before_pooler':
        return last_hidden[:, 0].cpu()
    elif pooler == "avg":
        return ((last_hidden * batch['attention_mask'].unsqueeze(-1)).sum(1) / batch['attention_mask'].sum(-1).unsqueeze(-1)).cpu()
    elif pooler == "avg_first_last":
        first_hidden = hidden_states[1]
        last_hidden = hidden_states[-1]
        pooled_result = ((first_hidden + last_hidden) / 2.0 * batch['attention_mask'].unsqueeze(-1)).sum(1) / batch['attention_mask'].sum(-1).unsqueeze(-1)
        return pooled_result.cpu()
    elif pooler == "avg_top2":
        second_last_hidden = hidden_states[-2]
        last_hidden = hidden_states[-1]
        pooled_result = ((last_hidden + second_last_hidden) / 2.0 * batch['attention_mask'].unsqueeze(-1)).sum(1) / batch['attention_mask'].sum(-1).unsqueeze(-1)
        return pooled_result.cpu()
    raise NotImplementedError


# --- an in-memory word-level tokenizer with the backbone's special tokens (no download) ---
WORDS = ("a man woman child dog cat is are was playing sleeping running eating outside inside the on in at park "
         "house guitar ball food red blue two three people sitting standing nobody sings loudly quietly near "
         "water beach street car bike").split()


def build_tokenizer(kind):
    if kind == "roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        bos, eos, pad, unk = "<s>", "</s>", "<pad>", "<unk>"
        extra = {"bos_token": bos, "eos_token": eos, "cls_token": bos, "sep_token": eos, "mask_token": "<mask>"}
        names = ["input_ids", "attention_mask"]
    else:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        bos, eos, pad, unk = "[CLS]", "[SEP]", "[PAD]", "[UNK]"
        extra = {"cls_token": bos, "sep_token": eos, "mask_token": "[MASK]"}
        names = ["input_ids", "token_type_ids", "attention_mask"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B:1 {eos}:1",
        special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk, padding_side="right",
                                   model_input_names=names, **extra)


# --- the reference: one sentence at a time, no padding and no mask ---
def reference_pool(model, encoder, tokenizer, sentence, pooler_type):
    ids = torch.tensor([tokenizer(sentence)["input_ids"]])
    out = encoder(ids, output_hidden_states=True, return_dict=True)
    hs = out.hidden_states
    if pooler_type in ("cls", "cls_before_pooler"):
        v = out.last_hidden_state[0, 0]
    elif pooler_type == "avg":
        v = hs[-1][0].mean(0)
    elif pooler_type == "avg_first_last":
        v = ((hs[1][0] + hs[-1][0]) / 2.0).mean(0)
    else:
        v = ((hs[-1][0] + hs[-2][0]) / 2.0).mean(0)
    if pooler_type == "cls":
        v = model.mlp(v)
    return v


def cosine(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def run(kind, pooler_type, triples):
    tokenizer = build_tokenizer(kind)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64)
    if kind == "roberta":
        config = RobertaConfig(pad_token_id=tokenizer.pad_token_id, bos_token_id=0, eos_token_id=2, **common)
        cl_class, enc_name = RobertaForCL, "roberta"
    else:
        config = BertConfig(pad_token_id=tokenizer.pad_token_id, **common)
        cl_class, enc_name = BertForCL, "bert"
    model_args = SimpleNamespace(pooler_type=pooler_type, temp=0.05, hard_negative_weight=0.3, do_mlm=False,
                                 mlm_weight=0.1, mlp_only_train=False)
    model = cl_class(config, model_args=model_args).eval()
    encoder = getattr(model, enc_name)
    data_args = SimpleNamespace(max_seq_length=32, pad_to_max_length=False)

    examples = {"sent0": [t[0] for t in triples], "sent1": [t[1] for t in triples], "hard_neg": [t[2] for t in triples]}
    feats = prepare_features(examples, tokenizer, data_args)
    features = [{k: feats[k][i] for k in feats} for i in range(len(triples))]
    batch = OurDataCollatorWithPadding(tokenizer)(features)
    am = batch["attention_mask"]
    assert am.dim() == 3 and am.shape[1] == 3 and not bool(am.all())   # some sentences are padded

    with torch.no_grad():
        out, pooled = model(**batch, return_dict=True)

        bs = len(triples)
        ref = torch.stack([torch.stack([reference_pool(model, encoder, tokenizer, s, pooler_type) for s in t])
                           for t in triples])
        assert torch.allclose(pooled, ref, atol=1e-5), (kind, pooler_type, (pooled - ref).abs().max())

        # the logits and the loss by a double loop
        temp, w3 = model_args.temp, model_args.hard_negative_weight
        ref_logits = torch.zeros(bs, 2 * bs)
        for i in range(bs):
            for j in range(bs):
                ref_logits[i, j] = cosine(ref[i, 0], ref[j, 1]) / temp
                ref_logits[i, bs + j] = cosine(ref[i, 0], ref[j, 2]) / temp + (w3 if i == j else 0.0)
        ref_loss = 0.0
        for i in range(bs):
            row = ref_logits[i]
            ref_loss += -(row[i] - torch.logsumexp(row, 0))
        ref_loss = ref_loss / bs
        assert torch.allclose(out.logits, ref_logits, atol=1e-3), (kind, pooler_type, (out.logits - ref_logits).abs().max())
        assert abs(out.loss.item() - float(ref_loss)) < 1e-4, (kind, pooler_type, out.loss.item(), float(ref_loss))

        # sentemb_forward (sent_emb=True), as the trained model is used for encoding
        flat = [s for t in triples for s in t]
        enc = tokenizer(flat, padding=True, return_tensors="pt")
        emb = model(**enc, sent_emb=True, return_dict=True).pooler_output
        assert torch.allclose(emb, ref.view(-1, ref.shape[-1]), atol=1e-5), (kind, pooler_type)

        # evaluation.py's batcher over the raw encoder
        if pooler_type != "cls":
            ev = batcher(encoder, tokenizer, pooler_type, flat)
            ref_ev = torch.stack([reference_pool(model, encoder, tokenizer, s, pooler_type) for s in flat])
            assert torch.allclose(ev, ref_ev, atol=1e-5), (kind, pooler_type, (ev - ref_ev).abs().max())
    print(f"{kind:8s} {pooler_type:15s} loss {out.loss.item():.5f} == per-sentence reference {float(ref_loss):.5f}")


def main():
    triples = [
        ("a man is playing guitar", "a man sings loudly", "nobody is playing"),
        ("two dogs are running in the park near the water on the beach", "dogs outside",
         "the dogs are sleeping inside the house"),
        ("a child", "a child is eating food at the house", "a woman"),
        ("three people sitting on a red car in the street", "people are sitting", "nobody is sitting on the blue bike"),
    ]
    for kind, pooler_type in [("roberta", "avg_first_last"), ("roberta", "avg"), ("roberta", "cls"),
                              ("bert", "avg_top2"), ("bert", "avg_first_last")]:
        run(kind, pooler_type, triples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
