# Correct program (quiet batch quiet-r133b): PromptBERT sentence embeddings with template denoising.
# Ported from kongds/Prompt-BERT:
#   prompt_bert/models.py @165e47e7e6d87e75339124e3ecbfe6a0c126997e (MLPLayer, Similarity, cl_init, cl_forward with
#     get_delta: the template run alone at 50 shifted lengths, pooler = last_hidden[input_ids == mask_token_id]
#     minus delta[attention_mask.sum(-1) - template_len]; sentemb_forward: the template spliced around each padded
#     [CLS] s [SEP] row, attention_mask rebuilt as input_ids != pad_token_id, delta over 128 lengths; BertForCL),
#   train.py @0947a8a4d9783e11615eebc6c0414d4252ce52d5 (template parsing into bs / es, prepare_features: bs + s + es
#     right-padded by hand with attention_mask len(t) * [1] + pad * [0]; OurDataCollatorWithPadding: tokenizer.pad of
#     the flattened pairs and view(bs, num_sent, -1); model.bs / es / mask_embedding_template).
# The template is the README's `*cls*This_sentence_:_"*sent_0*"_means*mask*.*sep+*`. The encoder is a tiny
# BertConfig built in memory (random init, dropout off so the check is deterministic) and the tokenizer a
# BertTokenizerFast over a small word vocabulary written to a temporary directory; padding is on the right.
# Self-check: every sentence wrapped in the template and encoded alone (no padding, no attention_mask), with its own
# template-only run at its own length, gives the reference embedding; the batched training forward (pairs), its
# contrastive loss and the evaluation forward (sentemb_forward) must match the references; a few steps lower the loss.
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel, BertPreTrainedModel, BertTokenizerFast, PreTrainedTokenizerBase
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions, SequenceClassifierOutput
from transformers.utils import PaddingStrategy

torch.manual_seed(0)


@dataclass
class ModelArguments:
    temp: float = 0.05
    mask_embedding_sentence: bool = True
    mask_embedding_sentence_template: str = '*cls*This_sentence_:_"*sent_0*"_means*mask*.*sep+*'
    mask_embedding_sentence_delta: bool = True
    mask_embedding_sentence_delta_freeze: bool = False
    mask_embedding_sentence_delta_no_position: bool = False
    mask_embedding_sentence_delta_no_delta_eval: bool = False
    mask_embedding_sentence_org_mlp: bool = False
    mask_embedding_sentence_num_masks: int = 1
    mask_embedding_sentence_avg: bool = False
    mlp_only_train: bool = False
    hard_negative_weight: float = 0.0
    mask_embedding_sentence_bs: str = ""
    mask_embedding_sentence_es: str = ""


class MLPLayer(nn.Module):
    """
    Head for getting sentence representations over RoBERTa/BERT's CLS representation.
    """

    def __init__(self, config, scale=1):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size * scale, config.hidden_size * scale)
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


def cl_init(cls, config):
    cls.mlp = MLPLayer(config, scale=cls.model_args.mask_embedding_sentence_num_masks)
    cls.sim = Similarity(temp=cls.model_args.temp)
    cls.post_init()


def cl_forward(cls, encoder, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
               return_dict=None):
    def get_delta(template_token, length=50):
        with torch.set_grad_enabled(not cls.model_args.mask_embedding_sentence_delta_freeze):
            device = input_ids.device
            d_input_ids = torch.Tensor(template_token).repeat(length, 1).to(device).long()
            d_position_ids = torch.arange(d_input_ids.shape[1]).to(device).unsqueeze(0).repeat(length, 1).long()
            if not cls.model_args.mask_embedding_sentence_delta_no_position:
                d_position_ids[:, len(cls.bs) + 1:] += torch.arange(length).to(device).unsqueeze(-1)
            m_mask = d_input_ids == cls.mask_token_id
            outputs = encoder(input_ids=d_input_ids, position_ids=d_position_ids, return_dict=True)
            last_hidden = outputs.last_hidden_state
            delta = last_hidden[m_mask]
            template_len = d_input_ids.shape[1]
            return delta, template_len

    if cls.model_args.mask_embedding_sentence_delta:
        delta, template_len = get_delta([cls.mask_embedding_template])

    batch_size = input_ids.size(0)
    # Number of sentences in one instance
    # 2: pair instance; 3: pair instance with a hard negative
    num_sent = input_ids.size(1)

    # Flatten input for encoding
    input_ids = input_ids.view((-1, input_ids.size(-1)))  # (bs * num_sent, len)
    attention_mask = attention_mask.view((-1, attention_mask.size(-1)))  # (bs * num_sent len)
    if token_type_ids is not None:
        token_type_ids = token_type_ids.view((-1, token_type_ids.size(-1)))  # (bs * num_sent, len)

    outputs = encoder(
        input_ids,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        return_dict=True,
    )

    # Pooling
    last_hidden = outputs.last_hidden_state
    pooler_output = last_hidden[input_ids == cls.mask_token_id]
    if cls.model_args.mask_embedding_sentence_delta:
        blen = attention_mask.sum(-1) - template_len
        pooler_output = pooler_output - delta[blen]
    pooler_output = pooler_output.view(batch_size * num_sent, -1)

    pooler_output = pooler_output.view((batch_size, num_sent, pooler_output.size(-1)))  # (bs, num_sent, hidden)
    pooler_output = cls.mlp(pooler_output)

    # Separate representation
    z1, z2 = pooler_output[:, 0], pooler_output[:, 1]
    if num_sent == 3:
        z3 = pooler_output[:, 2]

    cos_sim = cls.sim(z1.unsqueeze(1), z2.unsqueeze(0))
    if num_sent >= 3:
        z1_z3_cos = cls.sim(z1.unsqueeze(1), z3.unsqueeze(0))
        cos_sim = torch.cat([cos_sim, z1_z3_cos], 1)

    loss_fct = nn.CrossEntropyLoss()
    labels = torch.arange(cos_sim.size(0)).long().to(input_ids.device)
    loss = loss_fct(cos_sim, labels)

    return SequenceClassifierOutput(loss=loss, logits=cos_sim, hidden_states=pooler_output)


def sentemb_forward(cls, encoder, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                    return_dict=None):
    if cls.model_args.mask_embedding_sentence_delta and not cls.model_args.mask_embedding_sentence_delta_no_delta_eval:
        device = input_ids.device
        d_input_ids = torch.Tensor([cls.mask_embedding_template]).repeat(128, 1).to(device).long()
        d_position_ids = torch.arange(d_input_ids.shape[1]).to(device).unsqueeze(0).repeat(128, 1).long()
        if not cls.model_args.mask_embedding_sentence_delta_no_position:
            d_position_ids[:, len(cls.bs) + 1:] += torch.arange(128).to(device).unsqueeze(-1)
        m_mask = d_input_ids == cls.mask_token_id

        with torch.no_grad():
            outputs = encoder(input_ids=d_input_ids, position_ids=d_position_ids, return_dict=True)
            last_hidden = outputs.last_hidden_state
            delta = last_hidden[m_mask]
        delta.requires_grad = False
        template_len = d_input_ids.shape[1]

    if cls.model_args.mask_embedding_sentence and hasattr(cls, "bs"):
        new_input_ids = []
        bs = torch.LongTensor(cls.bs).to(input_ids.device)
        es = torch.LongTensor(cls.es).to(input_ids.device)

        for i in input_ids:
            ss = i.shape[0]
            ii = i[i != cls.pad_token_id]
            ni = [ii[:1], bs]
            if ii.shape[0] > 2:
                ni += [ii[1:-1]]
            ni += [es, ii[-1:]]
            if ii.shape[0] < i.shape[0]:
                ni += [i[i == cls.pad_token_id]]
            ni = torch.cat(ni)
            assert ss + bs.shape[0] + es.shape[0] == ni.shape[0]
            new_input_ids.append(ni)
        input_ids = torch.stack(new_input_ids, dim=0)
        attention_mask = (input_ids != cls.pad_token_id).long()
        token_type_ids = None

    outputs = encoder(
        input_ids,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        return_dict=True,
    )

    last_hidden = outputs.last_hidden_state
    pooler_output = last_hidden[input_ids == cls.mask_token_id]
    if cls.model_args.mask_embedding_sentence_delta and not cls.model_args.mask_embedding_sentence_delta_no_delta_eval:
        blen = attention_mask.sum(-1) - template_len
        pooler_output -= delta[blen]
    if cls.model_args.mask_embedding_sentence_avg:
        pooler_output = pooler_output.view(input_ids.shape[0], -1)
    else:
        pooler_output = pooler_output.view(input_ids.shape[0], -1, pooler_output.shape[-1]).mean(1)
    if not cls.model_args.mlp_only_train and not cls.model_args.mask_embedding_sentence_org_mlp:
        pooler_output = cls.mlp(pooler_output)

    return BaseModelOutputWithPoolingAndCrossAttentions(
        pooler_output=pooler_output,
        last_hidden_state=outputs.last_hidden_state,
    )


class BertForCL(BertPreTrainedModel):
    def __init__(self, config, *model_args, **model_kargs):
        super().__init__(config)
        self.model_args = model_kargs["model_args"]
        self.bert = BertModel(config, add_pooling_layer=False)
        cl_init(self, config)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                return_dict=None, sent_emb=False):
        if sent_emb:
            return sentemb_forward(self, self.bert, input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids, return_dict=return_dict)
        return cl_forward(self, self.bert, input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids, position_ids=position_ids, return_dict=return_dict)


@dataclass
class OurDataCollatorWithPadding:
    tokenizer: PreTrainedTokenizerBase
    padding: Union[bool, str, PaddingStrategy] = True
    max_length: Optional[int] = None
    pad_to_multiple_of: Optional[int] = None

    def __call__(self, features: List[Dict[str, Union[List[int], List[List[int]], torch.Tensor]]]) -> Dict[str, torch.Tensor]:
        special_keys = ["input_ids", "attention_mask", "token_type_ids"]
        bs = len(features)
        num_sent = len(features[0]["input_ids"])
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
        batch = {k: batch[k].view(bs, num_sent, -1) if k in special_keys else batch[k].view(bs, num_sent, -1)[:, 0]
                 for k in batch}
        return batch


WORDS = (
    "this sentence : \" means . a the man woman child dog cat is are was plays playing guitar piano runs running "
    "on in park street quickly slowly eats eating food pizza apple red blue big small two three people sit "
    "sitting bench near river under tree sings song loud"
).split()


def build_tokenizer(tmp):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    path = os.path.join(tmp, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizerFast(path, do_lower_case=True)


def parse_template(model_args, tokenizer):
    template = model_args.mask_embedding_sentence_template
    assert " " not in template
    template = template.replace("*mask*", tokenizer.mask_token) \
                       .replace("*sep+*", "") \
                       .replace("*cls*", "").replace("*sent_0*", " ")
    template = template.split(" ")
    model_args.mask_embedding_sentence_bs = template[0].replace("_", " ")
    model_args.mask_embedding_sentence_es = template[1].replace("_", " ")


def prepare_features(examples, tokenizer, model_args, max_seq_length=32):
    total = len(examples["sent0"])
    sentences = examples["sent0"] + examples["sent1"]
    bs = tokenizer.encode(model_args.mask_embedding_sentence_bs)[:-1]
    es = tokenizer.encode(model_args.mask_embedding_sentence_es)[1:]  # remove cls or bos
    sent_features = {"input_ids": [], "attention_mask": []}
    for s in sentences:
        s = tokenizer.encode(s, add_special_tokens=False)[:max_seq_length]
        sent_features["input_ids"].append(bs + s + es)
    ml = max([len(i) for i in sent_features["input_ids"]])
    for i in range(len(sent_features["input_ids"])):
        t = sent_features["input_ids"][i]
        sent_features["input_ids"][i] = t + [tokenizer.pad_token_id] * (ml - len(t))
        sent_features["attention_mask"].append(len(t) * [1] + (ml - len(t)) * [0])
    features = {}
    for key in sent_features:
        features[key] = [[sent_features[key][i], sent_features[key][i + total]] for i in range(total)]
    return [{k: features[k][i] for k in features} for i in range(total)]


# ---------------------------------------------------------------- reference: one sentence at a time, nothing padded
def reference_embedding(model, tokenizer, sentence, apply_mlp=True):
    bert = model.bert
    template = torch.tensor([model.mask_embedding_template])
    ids = torch.tensor([tokenizer.encode(model.model_args.mask_embedding_sentence_bs)[:-1]
                        + tokenizer.encode(sentence, add_special_tokens=False)
                        + tokenizer.encode(model.model_args.mask_embedding_sentence_es)[1:]])
    n_words = ids.shape[1] - template.shape[1]
    h = bert(input_ids=ids).last_hidden_state[0]
    mask_pos = (ids[0] == tokenizer.mask_token_id).nonzero()[0, 0]
    # the template alone, its end part placed where it sits after n_words words
    split = len(model.bs) + 1
    pos = torch.cat([torch.arange(split), torch.arange(split, template.shape[1]) + n_words]).unsqueeze(0)
    t = bert(input_ids=template, position_ids=pos).last_hidden_state[0]
    t_mask_pos = (template[0] == tokenizer.mask_token_id).nonzero()[0, 0]
    emb = h[mask_pos] - t[t_mask_pos]
    return model.mlp(emb) if apply_mlp else emb


def main():
    model_args = ModelArguments()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(tmp)
    assert tokenizer.padding_side == "right"
    parse_template(model_args, tokenizer)

    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=160, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForCL(config, model_args=model_args)
    model.mask_token_id = tokenizer.mask_token_id
    model.pad_token_id = tokenizer.pad_token_id
    model.bs = tokenizer.encode(model_args.mask_embedding_sentence_bs, add_special_tokens=False)
    model.es = tokenizer.encode(model_args.mask_embedding_sentence_es, add_special_tokens=False)
    model.mask_embedding_template = tokenizer.encode(model_args.mask_embedding_sentence_bs
                                                     + model_args.mask_embedding_sentence_es)
    assert len(model.mask_embedding_template) == len(model.bs) + len(model.es) + 2
    assert model.mask_embedding_template[1:-1] == model.bs + model.es
    print("template", tokenizer.decode(model.mask_embedding_template))

    examples = {
        "sent0": ["a man plays the guitar", "two people sitting on a bench near the river",
                  "the dog runs", "a child eats a red apple under the tree quickly"],
        "sent1": ["a man is playing the piano", "people sit near the river",
                  "a big dog is running in the park", "the child is eating food"],
    }
    features = prepare_features(examples, tokenizer, model_args)
    collator = OurDataCollatorWithPadding(tokenizer)
    batch = collator(features)
    am = batch["attention_mask"]
    assert am.shape[:2] == (4, 2) and (am.sum(-1) < am.shape[-1]).any(), "the pairs should be of unequal lengths"

    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch.get("token_type_ids"))
        ref = torch.stack([torch.stack([reference_embedding(model, tokenizer, examples[c][i]) for c in ("sent0", "sent1")])
                           for i in range(4)])
        err = (out.hidden_states - ref).abs().max().item()
        print(f"training forward: max |pair embedding - reference| = {err:.2e}")
        assert err < 1e-5, err
        ref_sim = model.sim(ref[:, 0].unsqueeze(1), ref[:, 1].unsqueeze(0))
        ref_loss = nn.functional.cross_entropy(ref_sim, torch.arange(4))
        print(f"loss {out.loss.item():.6f} reference {ref_loss.item():.6f}")
        assert abs(out.loss.item() - ref_loss.item()) < 1e-4

        # evaluation: plain [CLS] s [SEP] batches, right-padded by the tokenizer; the template goes in inside
        eval_sents = examples["sent0"] + ["a cat", "three small people sing a loud song in the street slowly"]
        enc = tokenizer(eval_sents, padding=True, return_tensors="pt")
        emb = model(**enc, sent_emb=True).pooler_output
        ref_eval = torch.stack([reference_embedding(model, tokenizer, s) for s in eval_sents])
        err = (emb - ref_eval).abs().max().item()
        print(f"sentemb_forward: max |embedding - reference| = {err:.2e}")
        assert err < 1e-5, err

    # a few training steps on the pairs lower the contrastive loss
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     token_type_ids=batch.get("token_type_ids")).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("losses", " ".join(f"{v:.4f}" for v in losses))
    assert losses[-1] < losses[0]
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
