# Citation: kongds/Prompt-BERT @690ba6ef3a1d954c24d9a992ff8e339816866a05: prompt_bert/models.py (BertForCL,
#   cl_init, sentemb_forward with mask_embedding_sentence + mask_embedding_sentence_delta +
#   mask_embedding_sentence_org_mlp, the "sup-bert" eval flags of run.sh), train.py (template -> bs / es /
#   mask_embedding_template), evaluation.py (batcher: right-padded tokenizer batch, padding=True; the
#   project's batch_encode_plus is tokenizer(...) in transformers 5).
# Prompt-based sentence embeddings over a right-padded BERT batch: sentemb_forward rebuilds every row as
# [CLS] bs sentence es [SEP] [PAD]..., keeping the row's padding at the end, recomputes
# attention_mask = (input_ids != pad_token_id), and pools the hidden state of the [MASK] token. Template
# denoising runs the template alone 128 times (no padding, no mask), position ids of es shifted by 0..127,
# and subtracts the row delta[blen] with blen = attention_mask.sum(-1) - template_len, the row's sentence
# length. Checked: every embedding against the sentence run alone, unpadded and without a mask, minus its
# template run alone with es placed after that many positions.
import os
import tempfile
from types import SimpleNamespace

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel, BertPreTrainedModel, BertTokenizer
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

torch.manual_seed(0)


class MLPLayer(nn.Module):
    def __init__(self, config, scale=1):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size * scale, config.hidden_size * scale)
        self.activation = nn.Tanh()

    def forward(self, features, **kwargs):
        x = self.dense(features)
        x = self.activation(x)
        return x


class Similarity(nn.Module):
    def __init__(self, temp):
        super().__init__()
        self.temp = temp
        self.cos = nn.CosineSimilarity(dim=-1)

    def forward(self, x, y):
        return self.cos(x, y) / self.temp


def cl_init(cls, config):
    if cls.model_args.mask_embedding_sentence_org_mlp:
        from transformers.models.bert.modeling_bert import BertPredictionHeadTransform
        cls.mlp = BertPredictionHeadTransform(config)
    else:
        cls.mlp = MLPLayer(config, scale=cls.model_args.mask_embedding_sentence_num_masks)
    cls.sim = Similarity(temp=cls.model_args.temp)
    cls.post_init()  # cls.init_weights() in transformers 4


def sentemb_forward(cls, encoder, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                    head_mask=None, inputs_embeds=None, labels=None, output_attentions=None,
                    output_hidden_states=None, return_dict=None):
    if cls.model_args.mask_embedding_sentence_delta and not cls.model_args.mask_embedding_sentence_delta_no_delta_eval:
        device = input_ids.device
        d_input_ids = torch.Tensor([cls.mask_embedding_template]).repeat(128, 1).to(device).long()
        d_position_ids = torch.arange(d_input_ids.shape[1]).to(device).unsqueeze(0).repeat(128, 1).long()
        if not cls.model_args.mask_embedding_sentence_delta_no_position:
            d_position_ids[:, len(cls.bs) + 1:] += torch.arange(128).to(device).unsqueeze(-1)
        m_mask = d_input_ids == cls.mask_token_id

        with torch.no_grad():
            outputs = encoder(input_ids=d_input_ids, position_ids=d_position_ids, output_hidden_states=True,
                              return_dict=True)
            last_hidden = outputs.last_hidden_state
            delta = last_hidden[m_mask]
        delta.requires_grad = False
        template_len = d_input_ids.shape[1]

    return_dict = return_dict if return_dict is not None else cls.config.use_return_dict

    if cls.model_args.mask_embedding_sentence and hasattr(cls, 'bs'):
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
        inputs_embeds=inputs_embeds,
        output_attentions=output_attentions,
        output_hidden_states=False,
        return_dict=True,
    )

    if cls.model_args.mask_embedding_sentence and hasattr(cls, 'bs'):
        last_hidden = outputs.last_hidden_state
        pooler_output = last_hidden[input_ids == cls.mask_token_id]
        if cls.model_args.mask_embedding_sentence_delta and not cls.model_args.mask_embedding_sentence_delta_no_delta_eval:
            blen = attention_mask.sum(-1) - template_len
            if cls.model_args.mask_embedding_sentence_org_mlp and not cls.model_args.mlp_only_train:
                pooler_output, delta = cls.mlp(pooler_output), cls.mlp(delta)
            pooler_output -= delta[blen]

        if cls.model_args.mask_embedding_sentence_avg:
            pooler_output = pooler_output.view(input_ids.shape[0], -1)
        else:
            pooler_output = pooler_output.view(input_ids.shape[0], -1, pooler_output.shape[-1]).mean(1)
    if not cls.model_args.mlp_only_train and not cls.model_args.mask_embedding_sentence_org_mlp:
        pooler_output = cls.mlp(pooler_output)

    if not return_dict:
        return (outputs[0], pooler_output) + outputs[2:]

    return BaseModelOutputWithPoolingAndCrossAttentions(
        pooler_output=pooler_output,
        last_hidden_state=outputs.last_hidden_state,
        hidden_states=outputs.hidden_states,
    )


class BertForCL(BertPreTrainedModel):
    def __init__(self, config, *model_args, **model_kargs):
        super().__init__(config)
        self.model_args = model_kargs["model_args"]
        self.bert = BertModel(config)
        cl_init(self, config)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, sent_emb=False):
        if sent_emb:
            return sentemb_forward(self, self.bert, input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids, head_mask=head_mask,
                                   inputs_embeds=inputs_embeds, labels=labels,
                                   output_attentions=output_attentions,
                                   output_hidden_states=output_hidden_states, return_dict=return_dict)
        raise NotImplementedError("cl_forward (training) is not ported")


# ---- a tiny word vocabulary, written to a temporary directory ---------------------------------------
words = ["this", "sentence", "of", '"', "means", ".", "a", "the", "cat", "dog", "sat", "on", "mat", "ran",
         "away", "quickly", "from", "big", "red", "house", "birds", "sing"]
vocab_dir = tempfile.mkdtemp()
with open(os.path.join(vocab_dir, "vocab.txt"), "w") as f:
    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
tokenizer = BertTokenizer(os.path.join(vocab_dir, "vocab.txt"), do_lower_case=True)

# ---- train.py: the "sup-bert" template and model attributes ----------------------------------------
model_args = SimpleNamespace(
    mask_embedding_sentence=True, mask_embedding_sentence_delta=True, mask_embedding_sentence_org_mlp=True,
    mask_embedding_sentence_delta_no_delta_eval=False, mask_embedding_sentence_delta_no_position=False,
    mask_embedding_sentence_avg=False, mask_embedding_sentence_num_masks=1, mlp_only_train=False, temp=0.05,
    mask_embedding_sentence_template='*cls*_This_sentence_of_"*sent_0*"_means*mask*.*sep+*',
)
template = model_args.mask_embedding_sentence_template
assert ' ' not in template
template = template.replace('*mask*', tokenizer.mask_token) \
                   .replace('*sep+*', '') \
                   .replace('*cls*', '').replace('*sent_0*', ' ')
template = template.split(' ')
model_args.mask_embedding_sentence_bs = template[0].replace('_', ' ')
model_args.mask_embedding_sentence_es = template[1].replace('_', ' ')

config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=160, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
config._attn_implementation = "eager"
model = BertForCL(config, model_args=model_args)
model.bs = tokenizer.encode(model_args.mask_embedding_sentence_bs, add_special_tokens=False)
model.es = tokenizer.encode(model_args.mask_embedding_sentence_es, add_special_tokens=False)
model.mask_token_id = tokenizer.mask_token_id
model.pad_token_id = tokenizer.pad_token_id
model.mask_embedding_template = tokenizer.encode(model_args.mask_embedding_sentence_bs
                                                 + model_args.mask_embedding_sentence_es)
assert len(model.mask_embedding_template) == len(model.bs) + len(model.es) + 2
assert model.mask_embedding_template[1:-1] == model.bs + model.es
model.eval()

# ---- evaluation.py batcher ---------------------------------------------------------------------------
sentences = ["the cat sat on the mat", "birds sing", "a big red dog ran away quickly from the house", "cat"]
batch = tokenizer(sentences, return_tensors='pt', padding=True)
with torch.no_grad():
    outputs = model(**batch, output_hidden_states=True, return_dict=True, sent_emb=True)
    pooler_output = outputs.pooler_output
assert (batch["attention_mask"] == 0).any()

# ---- reference: each sentence alone, unpadded, no attention mask ------------------------------------
cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
bs, es = model.bs, model.es
for i, s in enumerate(sentences):
    sent_ids = tokenizer.encode(s, add_special_tokens=False)
    n = len(sent_ids)
    ids = torch.tensor([[cls_id] + bs + sent_ids + es + [sep_id]])
    mask_pos = 1 + len(bs) + n + es.index(tokenizer.mask_token_id)
    with torch.no_grad():
        h = model.bert(input_ids=ids).last_hidden_state[0, mask_pos]
        # the template alone, its es placed after n missing sentence positions
        t_ids = torch.tensor([model.mask_embedding_template])
        t_pos = torch.tensor([list(range(1 + len(bs))) + [1 + len(bs) + n + k for k in range(len(es) + 1)]])
        t_mask_pos = 1 + len(bs) + es.index(tokenizer.mask_token_id)
        d = model.bert(input_ids=t_ids, position_ids=t_pos).last_hidden_state[0, t_mask_pos]
        ref = model.mlp(h) - model.mlp(d)
    torch.testing.assert_close(pooler_output[i], ref, rtol=1e-5, atol=1e-5)

cos = model.sim(pooler_output.unsqueeze(1), pooler_output.unsqueeze(0)) * model.sim.temp
print("cosine similarities\n", cos.round(decimals=3))
print("ok: prompt [MASK] embeddings (template-denoised) match each sentence run alone")
