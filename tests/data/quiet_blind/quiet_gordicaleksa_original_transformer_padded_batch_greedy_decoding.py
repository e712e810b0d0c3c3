# Citation: gordicaleksa/pytorch-original-transformer @d5b29a41c5c3f68e1bcd0c528a58281632fa9d6d:
#   models/definitions/transformer_model.py (Transformer.forward / encode / decode, Encoder, EncoderLayer, Decoder,
#   DecoderLayer, SublayerLogic, DecoderGenerator, PositionwiseFeedForwardNet, MultiHeadedAttention.attention /
#   forward, Embedding, PositionalEncoding, get_clones), utils/data_utils.py (get_masks_and_count_tokens_src,
#   get_masks_and_count_tokens_trg, get_masks_and_count_tokens, get_src_and_trg_batches; torchtext Field with
#   batch_first=True, pad_token '<pad>', trg init/eos '<s>'/'</s>'), utils/optimizers_and_distributions.py
#   (CustomLRAdamOptimizer, LabelSmoothingDistribution), training_script.py (train_val_loop's CORE PART, KLDivLoss
#   'batchmean') and utils/decoding_utils.py (greedy_decoding), called as translation_script.py calls it.
# A pre-LN "Attention is all you need" NMT model: src_mask = (src != pad).view(B, 1, 1, S) (True = attend) masks the
# encoder's self-attention and the decoder's source attention; trg_mask = (trg != pad).view(B, 1, 1, T) & a lower
# triangle (B, 1, T, T); MultiHeadedAttention fills scores where mask == False with -inf. Sources and targets are
# right-padded by the torchtext iterator. Greedy decoding encodes a padded batch of sources once, then re-decodes the
# whole growing target each step (no cache), keeps every row running past its '</s>' and cuts after it at the end.
# Changes: a stand-in for torchtext's Field / vocab (stoi / itos, specials <unk> <pad> <s> </s> -> 0 1 2 3), a tiny
# model size, and a few hundred steps on a toy reversal task so that the greedy outputs stop on '</s>'.
import copy
import math
import types

import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_num_threads(1)

BOS_TOKEN = '<s>'
EOS_TOKEN = '</s>'
PAD_TOKEN = "<pad>"

MODEL_DIMENSION = 32
NUMBER_OF_HEADS = 4
NUMBER_OF_LAYERS = 2
DROPOUT_PROB = 0.1
LABEL_SMOOTHING_VALUE = 0.1


# ---------------------------------------------------------------- models/definitions/transformer_model.py
class Transformer(nn.Module):

    def __init__(self, model_dimension, src_vocab_size, trg_vocab_size, number_of_heads, number_of_layers, dropout_probability, log_attention_weights=False):
        super().__init__()

        self.src_embedding = Embedding(src_vocab_size, model_dimension)
        self.trg_embedding = Embedding(trg_vocab_size, model_dimension)

        self.src_pos_embedding = PositionalEncoding(model_dimension, dropout_probability)
        self.trg_pos_embedding = PositionalEncoding(model_dimension, dropout_probability)

        mha = MultiHeadedAttention(model_dimension, number_of_heads, dropout_probability, log_attention_weights)
        pwn = PositionwiseFeedForwardNet(model_dimension, dropout_probability)
        encoder_layer = EncoderLayer(model_dimension, dropout_probability, mha, pwn)
        decoder_layer = DecoderLayer(model_dimension, dropout_probability, mha, pwn)

        self.encoder = Encoder(encoder_layer, number_of_layers)
        self.decoder = Decoder(decoder_layer, number_of_layers)

        self.decoder_generator = DecoderGenerator(model_dimension, trg_vocab_size)
        self.init_params()

    def init_params(self, default_initialization=False):
        if not default_initialization:
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)

    def forward(self, src_token_ids_batch, trg_token_ids_batch, src_mask, trg_mask):
        src_representations_batch = self.encode(src_token_ids_batch, src_mask)
        trg_log_probs = self.decode(trg_token_ids_batch, src_representations_batch, trg_mask, src_mask)
        return trg_log_probs

    def encode(self, src_token_ids_batch, src_mask):
        src_embeddings_batch = self.src_embedding(src_token_ids_batch)
        src_embeddings_batch = self.src_pos_embedding(src_embeddings_batch)
        src_representations_batch = self.encoder(src_embeddings_batch, src_mask)

        return src_representations_batch

    def decode(self, trg_token_ids_batch, src_representations_batch, trg_mask, src_mask):
        trg_embeddings_batch = self.trg_embedding(trg_token_ids_batch)
        trg_embeddings_batch = self.trg_pos_embedding(trg_embeddings_batch)
        trg_representations_batch = self.decoder(trg_embeddings_batch, src_representations_batch, trg_mask, src_mask)

        trg_log_probs = self.decoder_generator(trg_representations_batch)

        # Reshape into (B*T, V) as that's a suitable format for passing it into KL div loss
        trg_log_probs = trg_log_probs.reshape(-1, trg_log_probs.shape[-1])

        return trg_log_probs


class Encoder(nn.Module):

    def __init__(self, encoder_layer, number_of_layers):
        super().__init__()
        assert isinstance(encoder_layer, EncoderLayer), f'Expected EncoderLayer got {type(encoder_layer)}.'

        self.encoder_layers = get_clones(encoder_layer, number_of_layers)
        self.norm = nn.LayerNorm(encoder_layer.model_dimension)

    def forward(self, src_embeddings_batch, src_mask):
        src_representations_batch = src_embeddings_batch

        for encoder_layer in self.encoder_layers:
            # src_mask's role is to mask/ignore padded token representations in the multi-headed self-attention module
            src_representations_batch = encoder_layer(src_representations_batch, src_mask)

        return self.norm(src_representations_batch)


class EncoderLayer(nn.Module):

    def __init__(self, model_dimension, dropout_probability, multi_headed_attention, pointwise_net):
        super().__init__()
        num_of_sublayers_encoder = 2
        self.sublayers = get_clones(SublayerLogic(model_dimension, dropout_probability), num_of_sublayers_encoder)

        self.multi_headed_attention = multi_headed_attention
        self.pointwise_net = pointwise_net

        self.model_dimension = model_dimension

    def forward(self, src_representations_batch, src_mask):
        encoder_self_attention = lambda srb: self.multi_headed_attention(query=srb, key=srb, value=srb, mask=src_mask)

        src_representations_batch = self.sublayers[0](src_representations_batch, encoder_self_attention)
        src_representations_batch = self.sublayers[1](src_representations_batch, self.pointwise_net)

        return src_representations_batch


class Decoder(nn.Module):

    def __init__(self, decoder_layer, number_of_layers):
        super().__init__()
        assert isinstance(decoder_layer, DecoderLayer), f'Expected DecoderLayer got {type(decoder_layer)}.'

        self.decoder_layers = get_clones(decoder_layer, number_of_layers)
        self.norm = nn.LayerNorm(decoder_layer.model_dimension)

    def forward(self, trg_embeddings_batch, src_representations_batch, trg_mask, src_mask):
        trg_representations_batch = trg_embeddings_batch

        for decoder_layer in self.decoder_layers:
            # Target mask masks pad tokens as well as future tokens (current target token can't look forward)
            trg_representations_batch = decoder_layer(trg_representations_batch, src_representations_batch, trg_mask, src_mask)

        return self.norm(trg_representations_batch)


class DecoderLayer(nn.Module):

    def __init__(self, model_dimension, dropout_probability, multi_headed_attention, pointwise_net):
        super().__init__()
        num_of_sublayers_decoder = 3
        self.sublayers = get_clones(SublayerLogic(model_dimension, dropout_probability), num_of_sublayers_decoder)

        self.trg_multi_headed_attention = copy.deepcopy(multi_headed_attention)
        self.src_multi_headed_attention = copy.deepcopy(multi_headed_attention)
        self.pointwise_net = pointwise_net

        self.model_dimension = model_dimension

    def forward(self, trg_representations_batch, src_representations_batch, trg_mask, src_mask):
        srb = src_representations_batch  # simple/short alias
        decoder_trg_self_attention = lambda trb: self.trg_multi_headed_attention(query=trb, key=trb, value=trb, mask=trg_mask)
        decoder_src_attention = lambda trb: self.src_multi_headed_attention(query=trb, key=srb, value=srb, mask=src_mask)

        trg_representations_batch = self.sublayers[0](trg_representations_batch, decoder_trg_self_attention)
        trg_representations_batch = self.sublayers[1](trg_representations_batch, decoder_src_attention)
        trg_representations_batch = self.sublayers[2](trg_representations_batch, self.pointwise_net)

        return trg_representations_batch


class SublayerLogic(nn.Module):
    def __init__(self, model_dimension, dropout_probability):
        super().__init__()
        self.norm = nn.LayerNorm(model_dimension)
        self.dropout = nn.Dropout(p=dropout_probability)

    def forward(self, representations_batch, sublayer_module):
        return representations_batch + self.dropout(sublayer_module(self.norm(representations_batch)))


class DecoderGenerator(nn.Module):
    def __init__(self, model_dimension, vocab_size):
        super().__init__()

        self.linear = nn.Linear(model_dimension, vocab_size)
        self.log_softmax = nn.LogSoftmax(dim=-1)

    def forward(self, trg_representations_batch):
        return self.log_softmax(self.linear(trg_representations_batch))


class PositionwiseFeedForwardNet(nn.Module):
    def __init__(self, model_dimension, dropout_probability, width_mult=4):
        super().__init__()

        self.linear1 = nn.Linear(model_dimension, width_mult * model_dimension)
        self.linear2 = nn.Linear(width_mult * model_dimension, model_dimension)

        self.dropout = nn.Dropout(p=dropout_probability)
        self.relu = nn.ReLU()

    def forward(self, representations_batch):
        return self.linear2(self.dropout(self.relu(self.linear1(representations_batch))))


class MultiHeadedAttention(nn.Module):

    def __init__(self, model_dimension, number_of_heads, dropout_probability, log_attention_weights):
        super().__init__()
        assert model_dimension % number_of_heads == 0, f'Model dimension must be divisible by the number of heads.'

        self.head_dimension = int(model_dimension / number_of_heads)
        self.number_of_heads = number_of_heads

        self.qkv_nets = get_clones(nn.Linear(model_dimension, model_dimension), 3)  # identity activation hence "nets"
        self.out_projection_net = nn.Linear(model_dimension, model_dimension)

        self.attention_dropout = nn.Dropout(p=dropout_probability)
        self.softmax = nn.Softmax(dim=-1)

        self.log_attention_weights = log_attention_weights
        self.attention_weights = None

    def attention(self, query, key, value, mask):
        # query/key/value shape = (B, NH, S/T, HD), scores shape = (B, NH, S, S), (B, NH, T, T) or (B, NH, T, S)
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(self.head_dimension)

        # mask shape = (B, 1, 1, S) or (B, 1, T, T) will get broad-casted (copied) as needed to match scores shape
        if mask is not None:
            scores.masked_fill_(mask == torch.tensor(False), float("-inf"))

        attention_weights = self.softmax(scores)

        attention_weights = self.attention_dropout(attention_weights)

        intermediate_token_representations = torch.matmul(attention_weights, value)

        return intermediate_token_representations, attention_weights

    def forward(self, query, key, value, mask):
        batch_size = query.shape[0]

        query, key, value = [net(x).view(batch_size, -1, self.number_of_heads, self.head_dimension).transpose(1, 2)
                             for net, x in zip(self.qkv_nets, (query, key, value))]

        intermediate_token_representations, attention_weights = self.attention(query, key, value, mask)

        if self.log_attention_weights:
            self.attention_weights = attention_weights

        reshaped = intermediate_token_representations.transpose(1, 2).reshape(batch_size, -1, self.number_of_heads * self.head_dimension)

        token_representations = self.out_projection_net(reshaped)

        return token_representations


class Embedding(nn.Module):

    def __init__(self, vocab_size, model_dimension):
        super().__init__()
        self.embeddings_table = nn.Embedding(vocab_size, model_dimension)
        self.model_dimension = model_dimension

    def forward(self, token_ids_batch):
        assert token_ids_batch.ndim == 2, f'Expected: (batch size, max token sequence length), got {token_ids_batch.shape}'

        embeddings = self.embeddings_table(token_ids_batch)

        return embeddings * math.sqrt(self.model_dimension)


class PositionalEncoding(nn.Module):

    def __init__(self, model_dimension, dropout_probability, expected_max_sequence_length=5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout_probability)

        position_id = torch.arange(0, expected_max_sequence_length).unsqueeze(1)
        frequencies = torch.pow(10000., -torch.arange(0, model_dimension, 2, dtype=torch.float) / model_dimension)

        positional_encodings_table = torch.zeros(expected_max_sequence_length, model_dimension)
        positional_encodings_table[:, 0::2] = torch.sin(position_id * frequencies)  # sine on even positions
        positional_encodings_table[:, 1::2] = torch.cos(position_id * frequencies)  # cosine on odd positions

        self.register_buffer('positional_encodings_table', positional_encodings_table)

    def forward(self, embeddings_batch):
        assert embeddings_batch.ndim == 3 and embeddings_batch.shape[-1] == self.positional_encodings_table.shape[1], \
            f'Expected (batch size, max token sequence length, model dimension) got {embeddings_batch.shape}'

        positional_encodings = self.positional_encodings_table[:embeddings_batch.shape[1]]

        return self.dropout(embeddings_batch + positional_encodings)


def get_clones(module, num_of_deep_copies):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(num_of_deep_copies)])


# ---------------------------------------------------------------- utils/data_utils.py
def get_masks_and_count_tokens_src(src_token_ids_batch, pad_token_id):
    batch_size = src_token_ids_batch.shape[0]

    # src_mask shape = (B, 1, 1, S) check out attention function in transformer_model.py where masks are applied
    src_mask = (src_token_ids_batch != pad_token_id).view(batch_size, 1, 1, -1)
    num_src_tokens = torch.sum(src_mask.long())

    return src_mask, num_src_tokens


def get_masks_and_count_tokens_trg(trg_token_ids_batch, pad_token_id):
    batch_size = trg_token_ids_batch.shape[0]
    device = trg_token_ids_batch.device

    # Note: wherever the mask value is true we want to attend to that token, otherwise we mask (ignore) it.
    sequence_length = trg_token_ids_batch.shape[1]
    trg_padding_mask = (trg_token_ids_batch != pad_token_id).view(batch_size, 1, 1, -1)  # shape = (B, 1, 1, T)
    trg_no_look_forward_mask = torch.triu(torch.ones((1, 1, sequence_length, sequence_length), device=device) == 1).transpose(2, 3)

    trg_mask = trg_padding_mask & trg_no_look_forward_mask  # final shape = (B, 1, T, T)
    num_trg_tokens = torch.sum(trg_padding_mask.long())

    return trg_mask, num_trg_tokens


def get_masks_and_count_tokens(src_token_ids_batch, trg_token_ids_batch, pad_token_id, device):
    src_mask, num_src_tokens = get_masks_and_count_tokens_src(src_token_ids_batch, pad_token_id)
    trg_mask, num_trg_tokens = get_masks_and_count_tokens_trg(trg_token_ids_batch, pad_token_id)

    return src_mask, trg_mask, num_src_tokens, num_trg_tokens


def get_src_and_trg_batches(token_ids_batch):
    src_token_ids_batch, trg_token_ids_batch = token_ids_batch.src, token_ids_batch.trg

    # Target input should be shifted by 1 compared to the target output tokens
    trg_token_ids_batch_input = trg_token_ids_batch[:, :-1]

    # We reshape from (B, S) into (BxS, 1) as that's the the shape expected by LabelSmoothing
    trg_token_ids_batch_gt = trg_token_ids_batch[:, 1:].reshape(-1, 1)

    return src_token_ids_batch, trg_token_ids_batch_input, trg_token_ids_batch_gt


# ---------------------------------------------------------------- utils/optimizers_and_distributions.py
class CustomLRAdamOptimizer:

    def __init__(self, optimizer, model_dimension, num_of_warmup_steps):
        self.optimizer = optimizer
        self.model_size = model_dimension
        self.num_of_warmup_steps = num_of_warmup_steps

        self.current_step_number = 0

    def step(self):
        self.current_step_number += 1
        current_learning_rate = self.get_current_learning_rate()

        for p in self.optimizer.param_groups:
            p['lr'] = current_learning_rate

        self.optimizer.step()  # apply gradients

    def get_current_learning_rate(self):
        step = self.current_step_number
        warmup = self.num_of_warmup_steps

        return self.model_size ** (-0.5) * min(step ** (-0.5), step * warmup ** (-1.5))

    def zero_grad(self):
        self.optimizer.zero_grad()


class LabelSmoothingDistribution(nn.Module):

    def __init__(self, smoothing_value, pad_token_id, trg_vocab_size, device):
        assert 0.0 <= smoothing_value <= 1.0

        super(LabelSmoothingDistribution, self).__init__()

        self.confidence_value = 1.0 - smoothing_value
        self.smoothing_value = smoothing_value

        self.pad_token_id = pad_token_id
        self.trg_vocab_size = trg_vocab_size
        self.device = device

    def forward(self, trg_token_ids_batch):

        batch_size = trg_token_ids_batch.shape[0]
        smooth_target_distributions = torch.zeros((batch_size, self.trg_vocab_size), device=self.device)

        smooth_target_distributions.fill_(self.smoothing_value / (self.trg_vocab_size - 2))

        smooth_target_distributions.scatter_(1, trg_token_ids_batch, self.confidence_value)
        smooth_target_distributions[:, self.pad_token_id] = 0.

        # If we had a pad token as a target we set the distribution to all 0s instead of smooth labeled distribution
        smooth_target_distributions.masked_fill_(trg_token_ids_batch == self.pad_token_id, 0.)

        return smooth_target_distributions


# ---------------------------------------------------------------- utils/decoding_utils.py
def greedy_decoding(baseline_transformer, src_representations_batch, src_mask, trg_field_processor, max_target_tokens=100):
    device = next(baseline_transformer.parameters()).device
    pad_token_id = trg_field_processor.vocab.stoi[PAD_TOKEN]

    # Initial prompt is the beginning/start of the sentence token. Make it compatible shape with source batch => (B,1)
    target_sentences_tokens = [[BOS_TOKEN] for _ in range(src_representations_batch.shape[0])]
    trg_token_ids_batch = torch.tensor([[trg_field_processor.vocab.stoi[tokens[0]]] for tokens in target_sentences_tokens], device=device)

    # Set to true for a particular target sentence once it reaches the EOS (end-of-sentence) token
    is_decoded = [False] * src_representations_batch.shape[0]

    while True:
        trg_mask, _ = get_masks_and_count_tokens_trg(trg_token_ids_batch, pad_token_id)
        # Shape = (B*T, V) where T is the current token-sequence length and V target vocab size
        predicted_log_distributions = baseline_transformer.decode(trg_token_ids_batch, src_representations_batch, trg_mask, src_mask)

        # Extract only the indices of last token for every target sentence (we take every T-th token)
        num_of_trg_tokens = len(target_sentences_tokens[0])
        predicted_log_distributions = predicted_log_distributions[num_of_trg_tokens-1::num_of_trg_tokens]

        most_probable_last_token_indices = torch.argmax(predicted_log_distributions, dim=-1).cpu().numpy()

        predicted_words = [trg_field_processor.vocab.itos[index] for index in most_probable_last_token_indices]

        for idx, predicted_word in enumerate(predicted_words):
            target_sentences_tokens[idx].append(predicted_word)

            if predicted_word == EOS_TOKEN:  # once we find EOS token for a particular sentence we flag it
                is_decoded[idx] = True

        if all(is_decoded) or num_of_trg_tokens == max_target_tokens:
            break

        # Prepare the input for the next iteration (merge old token ids with the new column of most probable token ids)
        trg_token_ids_batch = torch.cat((trg_token_ids_batch, torch.unsqueeze(torch.tensor(most_probable_last_token_indices, device=device), 1)), 1)

    # Post process the sentences - remove everything after the EOS token
    target_sentences_tokens_post = []
    for target_sentence_tokens in target_sentences_tokens:
        try:
            target_index = target_sentence_tokens.index(EOS_TOKEN) + 1
        except:
            target_index = None

        target_sentence_tokens = target_sentence_tokens[:target_index]
        target_sentences_tokens_post.append(target_sentence_tokens)

    return target_sentences_tokens_post


# ---------------------------------------------------------------- stand-in for torchtext's Field / BucketIterator
WORDS = [f'w{i}' for i in range(12)]
ITOS = ['<unk>', PAD_TOKEN, BOS_TOKEN, EOS_TOKEN] + WORDS


class Vocab:
    def __init__(self, itos):
        self.itos = itos
        self.stoi = {w: i for i, w in enumerate(itos)}

    def __len__(self):
        return len(self.itos)


vocab = Vocab(ITOS)
src_field_processor = types.SimpleNamespace(vocab=vocab)
trg_field_processor = types.SimpleNamespace(vocab=vocab)
pad_token_id = src_field_processor.vocab.stoi[PAD_TOKEN]  # pad token id is the same for target as well
device = torch.device("cpu")


def process_src(sentences):
    # Field(pad_token=PAD_TOKEN, batch_first=True): right padding to the longest sentence
    longest = max(len(s) for s in sentences)
    return torch.tensor([[vocab.stoi[w] for w in s] + [pad_token_id] * (longest - len(s)) for s in sentences])


def process_trg(sentences):
    # Field(init_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, batch_first=True)
    return process_src([[BOS_TOKEN] + s + [EOS_TOKEN] for s in sentences])


def random_pair(generator):
    n = int(torch.randint(2, 9, (1,), generator=generator))
    src = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=generator)]
    return src, src[::-1]  # toy "translation": reverse the sentence


def make_batch(generator, batch_size):
    pairs = [random_pair(generator) for _ in range(batch_size)]
    return types.SimpleNamespace(src=process_src([p[0] for p in pairs]), trg=process_trg([p[1] for p in pairs]))


# ---------------------------------------------------------------- training_script.py (CORE PART)
baseline_transformer = Transformer(
    model_dimension=MODEL_DIMENSION,
    src_vocab_size=len(src_field_processor.vocab),
    trg_vocab_size=len(trg_field_processor.vocab),
    number_of_heads=NUMBER_OF_HEADS,
    number_of_layers=NUMBER_OF_LAYERS,
    dropout_probability=DROPOUT_PROB
).to(device)

kl_div_loss = nn.KLDivLoss(reduction='batchmean')
label_smoothing = LabelSmoothingDistribution(LABEL_SMOOTHING_VALUE, pad_token_id, len(trg_field_processor.vocab), device)
custom_lr_optimizer = CustomLRAdamOptimizer(
    torch.optim.Adam(baseline_transformer.parameters(), betas=(0.9, 0.98), eps=1e-9),
    MODEL_DIMENSION,
    100
)

generator = torch.Generator().manual_seed(1)
baseline_transformer.train()
for batch_idx in range(150):
    token_ids_batch = make_batch(generator, 32)
    src_token_ids_batch, trg_token_ids_batch_input, trg_token_ids_batch_gt = get_src_and_trg_batches(token_ids_batch)
    src_mask, trg_mask, num_src_tokens, num_trg_tokens = get_masks_and_count_tokens(src_token_ids_batch, trg_token_ids_batch_input, pad_token_id, device)

    predicted_log_distributions = baseline_transformer(src_token_ids_batch, trg_token_ids_batch_input, src_mask, trg_mask)
    smooth_target_distributions = label_smoothing(trg_token_ids_batch_gt)

    custom_lr_optimizer.zero_grad()
    loss = kl_div_loss(predicted_log_distributions, smooth_target_distributions)
    loss.backward()
    custom_lr_optimizer.step()
print(f'last training loss {loss.item():.4f}')


# ---------------------------------------------------------------- independent reference, one sentence at a time
def reference_attention(mha, x_q, x_kv, causal):
    # one sentence, no padding: plain per-head softmax, causal by an explicit loop bound
    hd, nh = mha.head_dimension, mha.number_of_heads
    q = mha.qkv_nets[0](x_q).view(-1, nh, hd)
    k = mha.qkv_nets[1](x_kv).view(-1, nh, hd)
    v = mha.qkv_nets[2](x_kv).view(-1, nh, hd)
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        last = i + 1 if causal else k.shape[0]
        for h in range(nh):
            s = (k[:last, h] @ q[i, h]) / math.sqrt(hd)
            w = torch.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[:last, h]
    return mha.out_projection_net(out.reshape(q.shape[0], -1))


def reference_encode(model, src_ids):
    x = model.src_embedding.embeddings_table(src_ids) * math.sqrt(MODEL_DIMENSION)
    x = x + model.src_pos_embedding.positional_encodings_table[:len(src_ids)]
    for layer in model.encoder.encoder_layers:
        h = layer.sublayers[0].norm(x)
        x = x + reference_attention(layer.multi_headed_attention, h, h, causal=False)
        x = x + layer.pointwise_net(layer.sublayers[1].norm(x))
    return model.encoder.norm(x)


def reference_decode(model, trg_ids, memory):
    x = model.trg_embedding.embeddings_table(trg_ids) * math.sqrt(MODEL_DIMENSION)
    x = x + model.trg_pos_embedding.positional_encodings_table[:len(trg_ids)]
    for layer in model.decoder.decoder_layers:
        h = layer.sublayers[0].norm(x)
        x = x + reference_attention(layer.trg_multi_headed_attention, h, h, causal=True)
        x = x + reference_attention(layer.src_multi_headed_attention, layer.sublayers[1].norm(x), memory, causal=False)
        x = x + layer.pointwise_net(layer.sublayers[2].norm(x))
    return torch.log_softmax(model.decoder_generator.linear(model.decoder.norm(x)), dim=-1)


def reference_greedy(model, src_words, max_target_tokens):
    memory = reference_encode(model, torch.tensor([vocab.stoi[w] for w in src_words]))
    tokens = [BOS_TOKEN]
    while True:
        log_probs = reference_decode(model, torch.tensor([vocab.stoi[w] for w in tokens]), memory)
        tokens.append(vocab.itos[int(log_probs[-1].argmax())])
        if tokens[-1] == EOS_TOKEN or len(tokens) - 1 == max_target_tokens:
            return tokens


baseline_transformer.eval()
with torch.no_grad():
    # (1) the training / validation forward over a right-padded batch against each pair alone
    eval_generator = torch.Generator().manual_seed(7)
    pairs = [random_pair(eval_generator) for _ in range(6)]
    pairs[0] = (pairs[0][0][:2], pairs[0][0][:2][::-1])  # a short source next to long ones
    token_ids_batch = types.SimpleNamespace(src=process_src([p[0] for p in pairs]), trg=process_trg([p[1] for p in pairs]))
    src_token_ids_batch, trg_token_ids_batch_input, trg_token_ids_batch_gt = get_src_and_trg_batches(token_ids_batch)
    assert (src_token_ids_batch == pad_token_id).any() and (trg_token_ids_batch_input == pad_token_id).any()
    src_mask, trg_mask, num_src_tokens, num_trg_tokens = get_masks_and_count_tokens(src_token_ids_batch, trg_token_ids_batch_input, pad_token_id, device)
    predicted_log_distributions = baseline_transformer(src_token_ids_batch, trg_token_ids_batch_input, src_mask, trg_mask)
    smooth_target_distributions = label_smoothing(trg_token_ids_batch_gt)
    loss = kl_div_loss(predicted_log_distributions, smooth_target_distributions)

    T = trg_token_ids_batch_input.shape[1]
    per_batch = predicted_log_distributions.view(len(pairs), T, -1)
    kl_sum_reference = 0.0
    for b, (src_words, trg_words) in enumerate(pairs):
        memory = reference_encode(baseline_transformer, torch.tensor([vocab.stoi[w] for w in src_words]))
        trg_in = [BOS_TOKEN] + trg_words
        trg_gt = torch.tensor([vocab.stoi[w] for w in trg_words + [EOS_TOKEN]]).view(-1, 1)
        ref = reference_decode(baseline_transformer, torch.tensor([vocab.stoi[w] for w in trg_in]), memory)
        n = len(trg_in)
        torch.testing.assert_close(per_batch[b, :n], ref, atol=1e-4, rtol=1e-4)
        target = label_smoothing(trg_gt)
        kl_sum_reference += float(nn.functional.kl_div(ref, target, reduction='sum'))
    # 'batchmean' divides the summed KL by the B*T rows (pad rows have an all-zero target and add nothing)
    assert abs(loss.item() * len(pairs) * T - kl_sum_reference) < 1e-3 * max(1.0, kl_sum_reference), (loss.item(), kl_sum_reference)
    assert int(num_trg_tokens) == int((trg_token_ids_batch_input != pad_token_id).sum())

    # (2) translation_script.py's path with a padded batch of sources: encode once, greedy decode
    sources = [p[0] for p in pairs] + [['w3'], ['w0', 'w11', 'w5', 'w5', 'w2', 'w9', 'w7', 'w1', 'w4', 'w6']]
    src_token_ids_batch = process_src(sources)
    src_mask, _ = get_masks_and_count_tokens_src(src_token_ids_batch, pad_token_id)
    src_representations_batch = baseline_transformer.encode(src_token_ids_batch, src_mask)
    for b, src_words in enumerate(sources):
        torch.testing.assert_close(src_representations_batch[b, :len(src_words)],
                                   reference_encode(baseline_transformer, torch.tensor([vocab.stoi[w] for w in src_words])),
                                   atol=1e-4, rtol=1e-4)
    max_target_tokens = 14
    target_sentences_tokens = greedy_decoding(baseline_transformer, src_representations_batch, src_mask, trg_field_processor, max_target_tokens=max_target_tokens)

    n_correct = 0
    for src_words, decoded in zip(sources, target_sentences_tokens):
        reference = reference_greedy(baseline_transformer, src_words, max_target_tokens)
        assert decoded == reference, (src_words, decoded, reference)
        assert PAD_TOKEN not in decoded
        n_correct += decoded == [BOS_TOKEN] + src_words[::-1] + [EOS_TOKEN]
    print(f'eval loss {loss.item():.4f}; greedy outputs equal per-sentence references for {len(sources)} sources; '
          f'{n_correct} exact reversals')
    assert sum(d[-1] == EOS_TOKEN for d in target_sentences_tokens) >= len(sources) // 2
print('OK')
