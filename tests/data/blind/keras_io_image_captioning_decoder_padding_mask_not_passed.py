# Citation: keras-team/keras-io#482 ("image captioning using CNN and Transformers", merged), review thread
#   on examples/vision/image_captioning.py (fchollet, 2021-05-30): "I think you should take the OR of the
#   padding mask (`mask` argument) and the causal mask ... You'd also need to pass the `mask` argument here:
#   batch_seq_pred = self.decoder(batch_seq_inp, encoder_out, training=training) ... And take the mask into
#   account when computing the loss and accuracy as well."  The author updated the PR accordingly.
# Upstream: examples/vision/image_captioning.py, TransformerDecoderBlock.call / get_causal_attention_mask,
#   ImageCaptioningModel._compute_caption_loss_and_acc / calculate_loss (Keras/TF, ported here to torch).
# Bug: the caption decoder's self-attention got only the causal mask, its cross-attention no mask, and
#   the training step never built the caption padding mask (token id 0) nor passed it to the decoder, so
#   padded captions were trained as if their pad slots were real tokens.
# Fix: mask = (batch_seq_true != 0), as the merged example builds it, is passed to the decoder, where padding_mask = mask[:, :, None] goes to
#   the cross-attention and combined_mask = minimum(mask[:, None, :], causal_mask) to the self-attention;
#   the same mask weights the loss and accuracy.
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

SEQ_LENGTH = 8
VOCAB_SIZE = 20
EMBED_DIM = 16
FF_DIM = 32
NUM_PATCHES = 9  # the CNN's 3x3 feature map, flattened


class MultiHeadAttention(nn.Module):
    """keras.layers.MultiHeadAttention: attention_mask is 1 = attend, 0 = masked, shape [B, T, S]."""

    def __init__(self, num_heads, key_dim):
        super().__init__()
        self.num_heads, self.key_dim = num_heads, key_dim
        self.query = nn.Linear(EMBED_DIM, num_heads * key_dim)
        self.key = nn.Linear(EMBED_DIM, num_heads * key_dim)
        self.value = nn.Linear(EMBED_DIM, num_heads * key_dim)
        self.output_dense = nn.Linear(num_heads * key_dim, EMBED_DIM)

    def _split(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.key_dim).transpose(1, 2)

    def forward(self, query, value, key, attention_mask=None, training=False):
        q = self._split(self.query(query)) * (1.0 / math.sqrt(self.key_dim))
        k = self._split(self.key(key))
        v = self._split(self.value(value))
        scores = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            # keras.layers.Softmax(mask): adder = (1 - mask) * -1e9, heads broadcast at axis 1
            mask = attention_mask[:, None, :, :].to(scores.dtype)
            scores = scores + (1.0 - mask) * -1e9
        probs = scores.softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
        return self.output_dense(out)


class TransformerEncoderBlock(nn.Module):
    def __init__(self, embed_dim, dense_dim, num_heads):
        super().__init__()
        self.attention_1 = MultiHeadAttention(num_heads, embed_dim)
        self.layernorm_1 = nn.LayerNorm(embed_dim)
        self.layernorm_2 = nn.LayerNorm(embed_dim)
        self.dense_1 = nn.Linear(embed_dim, embed_dim)

    def forward(self, inputs, training, mask=None):
        inputs = self.layernorm_1(inputs)
        inputs = F.relu(self.dense_1(inputs))
        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs, attention_mask=None)
        return self.layernorm_2(inputs + attention_output_1)


class PositionalEmbedding(nn.Module):
    def __init__(self, sequence_length, vocab_size, embed_dim):
        super().__init__()
        self.token_embeddings = nn.Embedding(vocab_size, embed_dim)
        self.position_embeddings = nn.Embedding(sequence_length, embed_dim)
        self.embed_scale = math.sqrt(embed_dim)

    def forward(self, inputs):
        positions = torch.arange(inputs.shape[-1])
        return self.token_embeddings(inputs) * self.embed_scale + self.position_embeddings(positions)


class TransformerDecoderBlock(nn.Module):
    def __init__(self, embed_dim, ff_dim, num_heads):
        super().__init__()
        self.attention_1 = MultiHeadAttention(num_heads, embed_dim)
        self.attention_2 = MultiHeadAttention(num_heads, embed_dim)
        self.ffn_layer_1 = nn.Linear(embed_dim, ff_dim)
        self.ffn_layer_2 = nn.Linear(ff_dim, embed_dim)
        self.layernorm_1 = nn.LayerNorm(embed_dim)
        self.layernorm_2 = nn.LayerNorm(embed_dim)
        self.layernorm_3 = nn.LayerNorm(embed_dim)
        self.embedding = PositionalEmbedding(SEQ_LENGTH, VOCAB_SIZE, embed_dim)
        self.out = nn.Linear(embed_dim, VOCAB_SIZE)

    def forward(self, inputs, encoder_outputs, training, mask=None):
        inputs = self.embedding(inputs)
        causal_mask = self.get_causal_attention_mask(inputs)

        if FIXED:
            padding_mask = mask[:, :, None].to(torch.int32)
            combined_mask = mask[:, None, :].to(torch.int32)
            combined_mask = torch.minimum(combined_mask, causal_mask)
            self_attention_mask, cross_attention_mask = combined_mask, padding_mask
        else:
            self_attention_mask, cross_attention_mask = causal_mask, None

        attention_output_1 = self.attention_1(
            query=inputs, value=inputs, key=inputs, attention_mask=self_attention_mask, training=training
        )
        out_1 = self.layernorm_1(inputs + attention_output_1)

        attention_output_2 = self.attention_2(
            query=out_1, value=encoder_outputs, key=encoder_outputs,
            attention_mask=cross_attention_mask, training=training,
        )
        out_2 = self.layernorm_2(out_1 + attention_output_2)

        ffn_out = F.relu(self.ffn_layer_1(out_2))
        ffn_out = self.ffn_layer_2(ffn_out)
        ffn_out = self.layernorm_3(ffn_out + out_2)
        return self.out(ffn_out).softmax(-1)  # Dense(VOCAB_SIZE, activation="softmax")

    def get_causal_attention_mask(self, inputs):
        batch_size, sequence_length = inputs.shape[0], inputs.shape[1]
        i = torch.arange(sequence_length)[:, None]
        j = torch.arange(sequence_length)
        mask = (i >= j).to(torch.int32)
        return mask[None].expand(batch_size, -1, -1)


class ImageCaptioningModel(nn.Module):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.cnn_model = nn.Linear(12, EMBED_DIM)  # stand-in for the frozen EfficientNet feature extractor
        self.encoder, self.decoder = encoder, decoder

    def loss(self, y_true, y_pred):
        # SparseCategoricalCrossentropy(from_logits=False, reduction="none")
        return F.nll_loss(torch.log(y_pred.clamp_min(1e-7)).transpose(1, 2), y_true, reduction="none")

    def calculate_loss(self, y_true, y_pred, mask):
        loss = self.loss(y_true, y_pred)
        mask = mask.to(loss.dtype)
        loss = loss * mask
        return loss.sum() / mask.sum()

    def calculate_accuracy(self, y_true, y_pred, mask):
        accuracy = (y_true == y_pred.argmax(-1)) & mask
        return accuracy.float().sum() / mask.float().sum()

    def _compute_caption_loss_and_acc(self, img_embed, batch_seq, training=True):
        encoder_out = self.encoder(img_embed, training=training)
        batch_seq_inp = batch_seq[:, :-1]
        batch_seq_true = batch_seq[:, 1:]
        if FIXED:
            mask = batch_seq_true != 0
            batch_seq_pred = self.decoder(batch_seq_inp, encoder_out, training=training, mask=mask)
        else:
            mask = torch.ones_like(batch_seq_true, dtype=torch.bool)  # compiled loss: every slot counts
            batch_seq_pred = self.decoder(batch_seq_inp, encoder_out, training=training)
        loss = self.calculate_loss(batch_seq_true, batch_seq_pred, mask)
        acc = self.calculate_accuracy(batch_seq_true, batch_seq_pred, mask)
        return loss, acc, batch_seq_pred

    def train_step(self, batch_img, batch_seq, optimizer):
        img_embed = self.cnn_model(batch_img)
        loss, acc, _ = self._compute_caption_loss_and_acc(img_embed, batch_seq, training=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item(), acc.item()


encoder = TransformerEncoderBlock(embed_dim=EMBED_DIM, dense_dim=FF_DIM, num_heads=1)
decoder = TransformerDecoderBlock(embed_dim=EMBED_DIM, ff_dim=FF_DIM, num_heads=2)
caption_model = ImageCaptioningModel(encoder, decoder)
optimizer = torch.optim.Adam(caption_model.parameters(), lr=1e-2)

# Flickr8k-style batch: TextVectorization(output_sequence_length=SEQ_LENGTH + 1) pads with 0 at the end.
# "<start>" = 1, "<end>" = 2.
batch_seq = torch.tensor([
    [1, 5, 9, 7, 11, 4, 13, 6, 2],
    [1, 8, 3, 2, 0, 0, 0, 0, 0],
    [1, 12, 10, 14, 2, 0, 0, 0, 0],
])
batch_img = torch.randn(3, NUM_PATCHES, 12)

for epoch in range(5):
    loss, acc = caption_model.train_step(batch_img, batch_seq, optimizer)
    print(f"epoch {epoch}: loss {loss:.4f} acc {acc:.4f}")

with torch.no_grad():
    img_embed = caption_model.cnn_model(batch_img)
    loss, acc, preds = caption_model._compute_caption_loss_and_acc(img_embed, batch_seq, training=False)
    print("eval loss on real tokens:", round(caption_model.calculate_loss(
        batch_seq[:, 1:], preds, batch_seq[:, 1:] != 0).item(), 4))
    print("greedy tokens, caption 2:", preds[1].argmax(-1).tolist())
