"""The cold pool's engine: several catalog models on one device, one active at a time (Talaria §3.4-§4.4).

``engine.ColdEngine`` is composed of ``queues.ModelQueues`` (the per-model call queues and the intake) and a
``policy.SwitchPolicy`` (``policy.IdleSwitching`` or ``slotted.SlotSwitching``, which drives the slot scheduler
through the one slot driver, ``driver.SlotDriver``); ``residency.ResidencyDriver`` carries out unified residency
plans. Nothing is imported here: ``driver`` is torch-free and the simulator and the test fake import it alone.
"""
