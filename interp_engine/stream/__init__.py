"""Activation streams: shuffled, resumable token rows from a model straight into a trainer."""

from .stream import ActivationStream as ActivationStream
from .stream import activation_stream as activation_stream
