"""What a run trains on: the packed training and held-out sequences (from `attnres.data`), their data loaders, and the
position in the data that a checkpoint saves, so that a resumed run reads on where it stopped.
"""

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .. import data
from ..options import TrainingConfig


def build_datasets(
    config: TrainingConfig, tokenizer: PreTrainedTokenizerBase, num_processes: int
) -> tuple[Dataset | IterableDataset, Dataset]:
    """(training sequences, held-out sequences), checked to hold at least one batch for every process."""
    name = config.dataset or "the standard-library corpus"
    documents = data.load_documents(config.dataset, config.dataset_config, config.split, config.streaming)
    data.check_text_field(documents, config.text_field, name)
    if config.eval_split is not None:
        held_out = data.load_documents(config.dataset, config.dataset_config, config.eval_split, config.streaming)
        data.check_text_field(held_out, config.text_field, f"{name} [{config.eval_split}]")
    else:
        documents, held_out = data.split_held_out(documents, config.eval_size, config.seed)
    if config.streaming:  # a map-style dataset is shuffled by the data loader's sampler instead
        documents = documents.shuffle(seed=config.seed, buffer_size=config.shuffle_buffer)

    train_sequences = data.pack(documents, tokenizer, config.text_field, config.seq_len)
    held_out_sequences = data.pack(held_out, tokenizer, config.text_field, config.seq_len)
    # Scored again at every evaluation: a fixed, materialised set
    held_out_sequences = Dataset.from_list(list(itertools.islice(held_out_sequences, config.max_eval_sequences)))

    one_batch = config.batch_size * num_processes
    available = sum(1 for _ in itertools.islice(train_sequences, one_batch))
    if available < one_batch:
        raise data.DataError(
            f"{name} packs into {available} training sequences of {config.seq_len} tokens, fewer than one batch "
            f"({config.batch_size} per process x {num_processes} processes). Use more data, or lower --seq-len or "
            "--batch-size."
        )
    if len(held_out_sequences) == 0:
        raise data.DataError(
            f"the held-out documents of {name} pack into no sequence of {config.seq_len} tokens: raise --eval-size, "
            "name a larger --eval-split, or lower --seq-len."
        )
    return train_sequences, held_out_sequences


def make_data_loaders(
    config: TrainingConfig, train_sequences: Dataset | IterableDataset, held_out_sequences: Dataset
) -> tuple[DataLoader, DataLoader]:
    """A shuffled training loader (Accelerate reseeds its sampler from the seed at every epoch) and a held-out one.

    Each loader has a generator of its own so that creating its iterators leaves the global RNG (dropout) alone, which
    keeps a resumed run on the same random stream as an uninterrupted one.
    """
    train_loader = DataLoader(
        train_sequences.with_format("torch"),
        batch_size=config.batch_size,
        shuffle=not config.streaming,
        drop_last=True,
        generator=torch.Generator().manual_seed(config.seed),
    )
    held_out_loader = DataLoader(
        held_out_sequences.with_format("torch"),
        batch_size=config.batch_size,
        generator=torch.Generator().manual_seed(config.seed),
    )
    return train_loader, held_out_loader


@dataclass
class TrainingProgress:
    """Where the run stands; saved with every checkpoint (Accelerate's `register_for_checkpointing`)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` each process has consumed
    tokens: int = 0  # tokens trained on, all processes together

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def training_batches(accelerator: Accelerator, loader: DataLoader, progress: TrainingProgress) -> Iterator[dict]:
    """Micro-batches epoch after epoch, from the position in `progress` on (skipping what was already trained on)."""
    while True:
        loader.set_epoch(progress.epoch)
        epoch_loader = accelerator.skip_first_batches(loader, progress.batches_in_epoch)
        for batch in epoch_loader:
            progress.batches_in_epoch += 1
            yield batch
        if progress.batches_in_epoch == 0:
            raise data.DataError("the training data ran out before the first batch")
        progress.epoch, progress.batches_in_epoch = progress.epoch + 1, 0
