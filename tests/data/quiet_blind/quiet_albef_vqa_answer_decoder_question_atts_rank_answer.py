# Correct program (quiet batch quiet-r72a).
# Citation: salesforce/ALBEF @91de3c19c370f31283bac2699bf4416c918159d3: models/model_vqa.py (ALBEF.forward
#   train and eval paths, rank_answer, tile) and models/xbert.py (BertModel.get_extended_attention_mask with
#   is_decoder, invert_attention_mask for encoder_attention_mask, BertLayer with cross-attention from
#   config.fusion_layer on, BertSelfAttention's additive (1 - mask) * -10000 scores, BertLMHeadModel.forward
#   with labels shifted by one and reduction='none' summed per row); the ViT (models/vit.py) written small.
# ALBEF's VQA model: a question encoder (BERT, layers >= fusion_layer cross-attend the image patches with
# image_atts all ones) over right-padded questions (quesiton.attention_mask), and an answer decoder (BERT
# decoder, fusion_layer = 0) over right-padded answers ([CLS] ... [SEP] [PAD]) that cross-attends the question
# states with encoder_attention_mask = the question's attention_mask, repeated per answer (train) or tiled per
# top-k candidate (rank_answer); answer pads become -100 targets.
# Self-check: the training loss equals a double loop over (question, answer) pairs run alone and unpadded,
# and rank_answer's top-k ids and probabilities equal a per-question loop that scores every candidate answer
# alone, unpadded, with no mask.
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss

torch.manual_seed(0)

PAD, CLS, SEP = 0, 1, 2


class BertConfig:
    def __init__(self, **kw):
        self.vocab_size = 30
        self.hidden_size = 32
        self.num_attention_heads = 4
        self.intermediate_size = 64
        self.max_position_embeddings = 32
        self.num_hidden_layers = 4
        self.fusion_layer = 2
        self.encoder_width = 32
        self.layer_norm_eps = 1e-12
        self.__dict__.update(kw)


# ---------------- models/xbert.py, written small ----------------
class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=PAD)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)))

    def forward(self, input_ids):
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, config, is_cross_attention):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        if is_cross_attention:
            self.key = nn.Linear(config.encoder_width, self.all_head_size)
            self.value = nn.Linear(config.encoder_width, self.all_head_size)
        else:
            self.key = nn.Linear(config.hidden_size, self.all_head_size)
            self.value = nn.Linear(config.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        mixed_query_layer = self.query(hidden_states)
        is_cross_attention = encoder_hidden_states is not None
        if is_cross_attention:
            key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
            value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
            attention_mask = encoder_attention_mask
        else:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(mixed_query_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class BertAttention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.self = BertSelfAttention(config, is_cross_attention)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        self_outputs = self.self(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask)
        return self.LayerNorm(self.dense(self_outputs) + hidden_states)


class BertLayer(nn.Module):
    def __init__(self, config, layer_num):
        super().__init__()
        self.attention = BertAttention(config)
        self.has_cross_attention = layer_num >= config.fusion_layer
        if self.has_cross_attention:
            self.layer_num = layer_num
            self.crossattention = BertAttention(config, is_cross_attention=self.has_cross_attention)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        if self.has_cross_attention:
            assert encoder_hidden_states is not None, "encoder_hidden_states must be given for cross-attention layers"
            attention_output = self.crossattention(
                attention_output, attention_mask, encoder_hidden_states, encoder_attention_mask
            )
        intermediate_output = F.gelu(self.intermediate(attention_output))
        return self.LayerNorm(self.output(intermediate_output) + attention_output)


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config, i) for i in range(config.num_hidden_layers)])

    def get_extended_attention_mask(self, attention_mask, input_shape, device, is_decoder):
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            # Provided a padding mask of dimensions [batch_size, seq_length]
            # - if the model is a decoder, apply a causal mask in addition to the padding mask
            # - if the model is an encoder, make the mask broadcastable to [batch_size, num_heads, seq_length, seq_length]
            if is_decoder:
                batch_size, seq_length = input_shape
                seq_ids = torch.arange(seq_length, device=device)
                causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
                causal_mask = causal_mask.to(attention_mask.dtype)
                extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
            else:
                extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError("Wrong shape for attention_mask (shape {})".format(attention_mask.shape))
        extended_attention_mask = extended_attention_mask.to(dtype=torch.float32)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        return extended_attention_mask

    def invert_attention_mask(self, encoder_attention_mask):
        if encoder_attention_mask.dim() == 3:
            encoder_extended_attention_mask = encoder_attention_mask[:, None, :, :]
        if encoder_attention_mask.dim() == 2:
            encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :]
        encoder_extended_attention_mask = encoder_extended_attention_mask.to(dtype=torch.float32)
        return (1.0 - encoder_extended_attention_mask) * -10000.0

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                is_decoder=False):
        input_shape = input_ids.size()
        batch_size, seq_length = input_shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length), device=device)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, input_shape, device, is_decoder)
        if encoder_hidden_states is not None:
            encoder_batch_size, encoder_sequence_length, _ = encoder_hidden_states.size()
            encoder_hidden_shape = (encoder_batch_size, encoder_sequence_length)
            if encoder_attention_mask is None:
                encoder_attention_mask = torch.ones(encoder_hidden_shape, device=device)
            encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask)
        else:
            encoder_extended_attention_mask = None
        hidden_states = self.embeddings(input_ids)
        for layer_module in self.layer:
            hidden_states = layer_module(
                hidden_states, extended_attention_mask, encoder_hidden_states, encoder_extended_attention_mask
            )
        return hidden_states


class BertLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                labels=None, reduction="mean", is_decoder=True):
        sequence_output = self.bert(input_ids, attention_mask=attention_mask,
                                    encoder_hidden_states=encoder_hidden_states,
                                    encoder_attention_mask=encoder_attention_mask, is_decoder=is_decoder)
        prediction_scores = self.cls(sequence_output)
        lm_loss = None
        if labels is not None:
            # we are doing next-token prediction; shift prediction scores and input ids by one
            shifted_prediction_scores = prediction_scores[:, :-1, :].contiguous()
            labels = labels[:, 1:].contiguous()
            loss_fct = CrossEntropyLoss(reduction=reduction)
            lm_loss = loss_fct(shifted_prediction_scores.view(-1, self.config.vocab_size), labels.view(-1))
            lm_loss = lm_loss.view(prediction_scores.size(0), -1).sum(1)
        return lm_loss, prediction_scores


# ---------------- models/vit.py, written small (no mask: every patch is real) ----------------
class Block(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def attn(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x):
        B = x.shape[0]
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


# ---------------- models/model_vqa.py ----------------
class Tokenized:
    def __init__(self, input_ids, attention_mask):
        self.input_ids = input_ids
        self.attention_mask = attention_mask


class Tokenizer:
    pad_token_id = PAD

    def __call__(self, seqs):
        # BertTokenizer(padding='longest'): [CLS] ... [SEP] then [PAD] on the right
        seqs = [[CLS] + s + [SEP] for s in seqs]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), PAD, dtype=torch.long)
        att = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        return Tokenized(ids, att)


def tile(x, dim, n_tile):
    init_dim = x.size(dim)
    repeat_idx = [1] * x.dim()
    repeat_idx[dim] = n_tile
    x = x.repeat(*(repeat_idx))
    order_index = torch.LongTensor(np.concatenate([init_dim * np.arange(n_tile) + i for i in range(init_dim)]))
    return torch.index_select(x, dim, order_index.to(x.device))


class ALBEF(nn.Module):
    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.visual_encoder = VisionTransformer()
        self.text_encoder = BertModel(BertConfig(num_hidden_layers=4, fusion_layer=2))
        self.text_decoder = BertLMHeadModel(BertConfig(num_hidden_layers=2, fusion_layer=0))

    def forward(self, image, quesiton, answer=None, k=None, weights=None, train=True):
        image_embeds = self.visual_encoder(image)
        image_atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long).to(image.device)
        if train:
            answer_targets = answer.input_ids.masked_fill(answer.input_ids == self.tokenizer.pad_token_id, -100)
            question_output = self.text_encoder(quesiton.input_ids, attention_mask=quesiton.attention_mask,
                                                encoder_hidden_states=image_embeds,
                                                encoder_attention_mask=image_atts)
            question_states = []
            question_atts = []
            for b, n in enumerate(k):
                question_states += [question_output[b]] * n
                question_atts += [quesiton.attention_mask[b]] * n
            question_states = torch.stack(question_states, 0)
            question_atts = torch.stack(question_atts, 0)
            answer_loss, _ = self.text_decoder(answer.input_ids, attention_mask=answer.attention_mask,
                                               encoder_hidden_states=question_states,
                                               encoder_attention_mask=question_atts,
                                               labels=answer_targets, reduction="none")
            loss = weights * answer_loss
            loss = loss.sum() / image.size(0)
            return loss
        else:
            question_output = self.text_encoder(quesiton.input_ids, attention_mask=quesiton.attention_mask,
                                                encoder_hidden_states=image_embeds,
                                                encoder_attention_mask=image_atts)
            topk_ids, topk_probs = self.rank_answer(question_output, quesiton.attention_mask,
                                                    answer.input_ids, answer.attention_mask, k)
            return topk_ids, topk_probs

    def rank_answer(self, question_states, question_atts, answer_ids, answer_atts, k):
        num_ques = question_states.size(0)
        start_ids = answer_ids[0, 0].repeat(num_ques, 1)  # bos token
        _, start_logits = self.text_decoder(start_ids, encoder_hidden_states=question_states,
                                            encoder_attention_mask=question_atts, reduction="none")
        logits = start_logits[:, 0, :]  # first token's logit
        answer_first_token = answer_ids[:, 1]
        prob_first_token = F.softmax(logits, dim=1).index_select(dim=1, index=answer_first_token)
        topk_probs, topk_ids = prob_first_token.topk(k, dim=1)
        input_ids = []
        input_atts = []
        for b, topk_id in enumerate(topk_ids):
            input_ids.append(answer_ids.index_select(dim=0, index=topk_id))
            input_atts.append(answer_atts.index_select(dim=0, index=topk_id))
        input_ids = torch.cat(input_ids, dim=0)
        input_atts = torch.cat(input_atts, dim=0)
        targets_ids = input_ids.masked_fill(input_ids == self.tokenizer.pad_token_id, -100)
        # repeat encoder's output for top-k answers
        question_states = tile(question_states, 0, k)
        question_atts = tile(question_atts, 0, k)
        answer_loss, _ = self.text_decoder(input_ids, attention_mask=input_atts,
                                           encoder_hidden_states=question_states,
                                           encoder_attention_mask=question_atts,
                                           labels=targets_ids, reduction="none")
        answer_loss = answer_loss.view(input_ids.size(0), -1)
        topk_probs = topk_probs.view(-1, 1)
        log_probs = torch.cat([topk_probs.log(), -answer_loss], dim=1)
        log_probs_sum = log_probs.sum(1)
        log_probs_sum = log_probs_sum.view(num_ques, k)
        topk_probs = F.softmax(log_probs_sum, dim=-1)
        topk_probs, rerank_id = topk_probs.topk(k, dim=1)
        topk_ids = torch.gather(topk_ids, 1, rerank_id)
        return topk_ids, topk_probs


model = ALBEF(Tokenizer()).eval()
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.3)

tok = model.tokenizer
images = torch.randn(3, 3, 16, 16)
questions = [[5, 9, 12, 7, 20, 11, 4], [8, 4], [11, 22, 6, 17]]
# two answers for question 0, one for question 1, three for question 2 (VQA's weighted answer lists)
answers = [[13], [14, 15, 16], [17, 18], [19], [13, 21], [22, 23, 24, 25]]
k_per_q = [2, 1, 3]
weights = torch.tensor([0.7, 0.3, 1.0, 0.5, 0.25, 0.25])
answer_list = [[13], [14, 15, 16], [17, 18], [19], [13, 21], [22, 23, 24, 25], [26], [27, 28, 29]]

q = tok(questions)
a = tok(answers)
assert (q.attention_mask == 0).any() and (a.attention_mask == 0).any()

with torch.no_grad():
    loss = model(images, q, a, k=k_per_q, weights=weights, train=True)
    al = tok(answer_list)
    topk_ids, topk_probs = model(images, q, al, k=3, train=False)


# ---------------- reference: each question alone, each answer alone, unpadded, no masks ----------------
def enc_alone(b):
    with torch.no_grad():
        img = model.visual_encoder(images[b : b + 1])
        ids = torch.tensor([[CLS] + questions[b] + [SEP]])
        return model.text_encoder(ids, encoder_hidden_states=img)


def seq_logprob(q_states, ans):
    # sum over the answer's tokens after [CLS] of log p(token | prefix, question), one unpadded sequence
    ids = torch.tensor([[CLS] + ans + [SEP]])
    with torch.no_grad():
        _, scores = model.text_decoder(ids, encoder_hidden_states=q_states)
    lp = F.log_softmax(scores[0, :-1], dim=-1)
    return sum(lp[t, ids[0, t + 1]] for t in range(ids.size(1) - 1))


ok = True
ref_loss = 0.0
i = 0
for b, n in enumerate(k_per_q):
    qs = enc_alone(b)
    for _ in range(n):
        ref_loss += weights[i] * (-seq_logprob(qs, answers[i]))
        i += 1
ref_loss = ref_loss / images.size(0)
dl = (loss - ref_loss).abs().item()
print(f"train loss batch={loss.item():.6f} ref={float(ref_loss):.6f} |d|={dl:.2e}")
ok &= dl < 1e-4

K = 3
for b in range(len(questions)):
    qs = enc_alone(b)
    with torch.no_grad():
        _, s = model.text_decoder(torch.tensor([[CLS]]), encoder_hidden_states=qs)
    p_first = F.softmax(s[0, 0], dim=-1)
    firsts = torch.tensor([ans[0] for ans in answer_list])
    pf = p_first[firsts]
    cand = sorted(range(len(answer_list)), key=lambda j: -pf[j].item())[:K]
    totals = torch.stack([pf[j].log() + seq_logprob(qs, answer_list[j]) for j in cand])
    probs = F.softmax(totals, dim=-1)
    order = sorted(range(K), key=lambda j: -probs[j].item())
    ref_ids = [cand[j] for j in order]
    ref_probs = torch.stack([probs[j] for j in order])
    dp = (topk_probs[b] - ref_probs).abs().max().item()
    print(f"question {b}: rank_answer ids={topk_ids[b].tolist()} ref={ref_ids}  max|dprob|={dp:.2e}")
    ok &= topk_ids[b].tolist() == ref_ids and dp < 1e-4

if not ok:
    print("MISMATCH")
    sys.exit(1)
print("OK")
