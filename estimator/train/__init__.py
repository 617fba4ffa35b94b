"""SDK 3's ``sagemaker.train`` on smsdp: ``ModelTrainer`` and its configs, with SDK 3's names.

    from estimator.train import ModelTrainer
    from estimator.train.configs import SourceCode, Compute, InputData, StoppingCondition
    from estimator.train.distributed import Torchrun, SMP

Never imports torch, nor the SageMaker SDK (a SageMaker job imports it when it is submitted).
"""

from estimator.train.model_trainer import Mode, ModelTrainer

__all__ = ["Mode", "ModelTrainer"]
