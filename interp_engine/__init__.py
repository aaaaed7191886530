"""interp_engine: activation capture for LLM interpretability.

One address space (``resid_post.10``, ``z.7``, ``router_logits.3``, ...) over two backends —
Hugging Face transformers (``"eager"``) and vLLM (``"vllm"``) — and a Ray cluster that serves
either with the same calls.
"""

from .address import SITES as SITES
from .address import Address as Address
from .address import FeatureAddress as FeatureAddress
from .points import ModelInfo as ModelInfo
from .address import format_address as format_address
from .address import parse_address as parse_address
from .address import to_address as to_address
from .analysis import accumulated_resid as accumulated_resid
from .analysis import decompose_resid as decompose_resid
from .analysis import final_scale as final_scale
from .analysis import head_contributions as head_contributions
from .analysis import logit_attribution as logit_attribution
from .analysis import stack as stack
from .cache import Cache as Cache
from .compare import relative_error as relative_error
from .edits import Add as Add
from .edits import Scale as Scale
from .edits import Set as Set
from .edits import Zero as Zero
from .dataset.build import ActivationDataset as ActivationDataset
from .dataset.build import build_dataset as build_dataset
from .dataset.dashboard import feature_dashboard as feature_dashboard
from .dataset.export import export_saelens as export_saelens
from .features import Dictionary as Dictionary
from .features import ce_loss_recovered as ce_loss_recovered
from .features import load_dictionary as load_dictionary
from .features import save_dictionary as save_dictionary
from .lens import LensTop as LensTop
from .lens import lens_top as lens_top
from .lens import logit_lens as logit_lens
from .loading import load_model as load_model
from .model import CaptureModel as CaptureModel
from .model import Completion as Completion
from .model import capture_generation as capture_generation
from .model import run_with_cache as run_with_cache
from .protocol import CaptureBackend as CaptureBackend
from .protocol import HasOProj as HasOProj
from .protocol import HasUnembedding as HasUnembedding
from .protocol import WritesShards as WritesShards
from .routing import expert_assignment as expert_assignment
from .service import Limits as Limits
from .service import ServiceInfo as ServiceInfo
from .service import ServiceModel as ServiceModel
from .service import connect as connect
from .service import serve as serve
from .service import shutdown as shutdown
from .tokens import PAD_ID as PAD_ID

from .errors import AddressError as AddressError
from .errors import AnalysisError as AnalysisError
from .errors import CacheFileError as CacheFileError
from .errors import Cancelled as Cancelled
from .errors import ClusterError as ClusterError
from .errors import DatasetBusyError as DatasetBusyError
from .errors import DatasetCorruptError as DatasetCorruptError
from .errors import DatasetExistsError as DatasetExistsError
from .errors import DatasetForeignFilesWarning as DatasetForeignFilesWarning
from .errors import DatasetLeaseWarning as DatasetLeaseWarning
from .errors import DatasetRepairWarning as DatasetRepairWarning
from .errors import DictionaryError as DictionaryError
from .errors import EngineMemoryError as EngineMemoryError
from .errors import EngineStopped as EngineStopped
from .errors import InputError as InputError
from .errors import InternalError as InternalError
from .errors import LimitExceeded as LimitExceeded
from .errors import LoopbackError as LoopbackError
from .errors import MissingActivations as MissingActivations
from .errors import MissingDictionary as MissingDictionary
from .errors import ModelNotFound as ModelNotFound
from .errors import PromptsError as PromptsError
from .errors import RoutingError as RoutingError
from .errors import ServiceAuthError as ServiceAuthError
from .errors import ServiceError as ServiceError
from .errors import ShardFailed as ShardFailed
from .errors import StorageError as StorageError
from .errors import UnsupportedModel as UnsupportedModel
from .errors import UnsupportedVllmVersion as UnsupportedVllmVersion

from .version import VERSION as __version__
