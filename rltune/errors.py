"""The error types rltune raises.

Library code raises a subclass of :class:`RltuneError` whose message says what is wrong and how to
fix it. Only the CLI turns one into an exit code (2) and a single line on stderr.
"""

from __future__ import annotations


class RltuneError(Exception):
    """Base class of every error rltune reports to a user."""


class ArtifactError(RltuneError):
    """A file passed between stages (job.yaml, stages.parquet, ...) does not match its schema.

    The message reads ``<file>: <dotted.field>: <what is wrong>`` so that a user can go straight to
    the line to fix.
    """

    def __init__(self, file: str, field: str, problem: str):
        self.file = str(file)
        self.field = field
        self.problem = problem
        where = f"{self.file}: {field}: " if field else f"{self.file}: "
        super().__init__(where + problem)


class UnknownKeyError(ArtifactError):
    """A mapping holds a key its schema does not define (usually a typo)."""


class WrongTypeError(ArtifactError):
    """A value has the wrong type or lies outside its allowed range or choices."""


class MissingFieldError(ArtifactError):
    """A required field is absent."""


class SchemaVersionError(ArtifactError):
    """The file was written by a newer rltune (or is unversioned) and cannot be read safely."""


class MalformedFileError(ArtifactError):
    """The file cannot be parsed at all: bad YAML, truncated Parquet, not a mapping, ..."""


class LaunchError(RltuneError):
    """A job could not be started, crashed, or ran past its time-out."""


class LogFormatError(RltuneError):
    """A framework log could not be read as the format asked for (or any format, with auto)."""


class DuplicateKeyError(MalformedFileError):
    """A YAML mapping names the same key twice; YAML would silently keep the last one.

    The message reads ``<file>: line <n>: <dotted.field>: duplicate key (the first is on line <m>); keep one``.
    """

    def __init__(self, file: str, field: str, problem: str, line: int | None = None):
        super().__init__(file, field, problem)
        self.line = line
        if line is not None:
            self.args = (f"{self.file}: line {line}: {field}: {problem}",)


class WrongArtifactError(ArtifactError):
    """The file is an rltune artifact of another kind (a diagnosis given where candidates are expected)."""


class OtherJobError(ArtifactError):
    """The file was made for another job than the one the command was given."""


class MeasurementError(ArtifactError):
    """A measured value in a log or stage table is impossible: a negative, infinite or absurd time.

    The message reads ``<file>: step <n>: <column>: <what is wrong>``.
    """

    def __init__(self, file: str, step: int | None, column: str, problem: str):
        super().__init__(file, column, problem)
        self.step = step
        if step is not None:
            self.args = (f"{self.file}: step {step}: {column}: {problem}",)
