# Engine workers: one allocation = one serving instance on one GPU (or a TP group: gpus_per_engine).
# Groups: "hot" instances pin one model; "cold" instances share a GPU among several models (Talaria §3.4).
# The engine id is <group>-<alloc index> (stable across reschedules); the config is rendered per
# allocation with that one engine, so scaling is `count` only. Health: `talaria health --engine` (a fresh
# heartbeat on NATS), run as a script check inside the task.
variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}
variable "image" {
  type    = string
  default = "talaria:cuda"
}
variable "nats_url" {
  type = string
}
variable "namespace" {
  type    = string
  default = "talaria"
}
variable "models_host_volume" {
  type        = string
  default     = "talaria-models"
  description = "Nomad host volume with the HF checkpoints (read-only)"
}
variable "hot_count" {
  type    = number
  default = 4
}
variable "hot_model" {
  type    = string
  default = "Qwen3-8B"
}
variable "cold_count" {
  type    = number
  default = 2
}
variable "cold_models" {
  type    = list(string)
  default = ["Llama-3.1-8B-Instruct", "Qwen2.5-7B-Instruct", "Mistral-7B-Instruct-v0.3"]
}
variable "gpus_per_engine" {
  type    = number
  default = 1
}
variable "min_gpu_memory" {
  type    = string
  default = "40 GiB"
}
variable "kv_cache_mb" {
  type    = number
  default = 40960
}
variable "kvstore_grpc_port" {
  type    = number
  default = 50061
}

job "talaria-engines" {
  datacenters = var.datacenters
  type        = "service"

  update {
    max_parallel      = 1
    health_check      = "checks"
    min_healthy_time  = "30s"
    healthy_deadline  = "10m"
    progress_deadline = "20m"
    auto_revert       = true
    stagger           = "30s"
  }

  group "hot" {
    count = var.hot_count

    constraint {
      attribute = "${meta.talaria_gpu_node}"
      value     = "true"
    }

    volume "models" {
      type      = "host"
      source    = var.models_host_volume
      read_only = true
    }

    restart {
      attempts = 3
      interval = "10m"
      delay    = "20s"
      mode     = "delay"
    }

    reschedule {
      delay          = "30s"
      delay_function = "exponential"
      max_delay      = "10m"
      unlimited      = true
    }

    service {
      name     = "talaria-engine"
      provider = "consul"
      tags     = ["hot", "engine-${NOMAD_GROUP_NAME}-${NOMAD_ALLOC_INDEX}"]
      check {
        name     = "heartbeat"
        type     = "script"
        task     = "engine"
        command  = "talaria"
        args     = ["health", "--config", "/local/cluster.yaml", "--engine", "${NOMAD_GROUP_NAME}-${NOMAD_ALLOC_INDEX}"]
        interval = "10s"
        timeout  = "8s"
        check_restart {
          limit = 3
          grace = "300s"
        }
      }
    }

    task "engine" {
      driver       = "docker"
      kill_signal  = "SIGTERM"
      kill_timeout = "40s"

      config {
        image        = var.image
        network_mode = "host"
        args         = ["engine", "--config", "/local/cluster.yaml", "--id", "${NOMAD_GROUP_NAME}-${NOMAD_ALLOC_INDEX}"]
        cap_add      = ["ipc_lock"]
        ulimit {
          memlock = "-1"
        }
        devices = [
          {
            host_path      = "/dev/infiniband"
            container_path = "/dev/infiniband"
          }
        ]
      }

      volume_mount {
        volume      = "models"
        destination = "/models"
        read_only   = true
      }

      env {
        NATS_URL                    = var.nats_url
        TALARIA__KVSTORE__HOST      = "${attr.unique.network.ip-address}"
        TALARIA__KVSTORE__PORT      = var.kvstore_grpc_port
        TALARIA__KVSTORE__PROTOCOL  = "rdma"
        TALARIA__KVSTORE__DATA_HOST = "${attr.unique.network.ip-address}"
        OTEL_SERVICE_NAME           = "talaria-engine"
      }

      template {
        destination = "local/cluster.yaml"
        data        = <<-EOT
        namespace: ${var.namespace}
        models_dir: /models
        synthesize_models: false
        engines:
          - id: {{ env "NOMAD_GROUP_NAME" }}-{{ env "NOMAD_ALLOC_INDEX" }}
            pool: hot
            models: ["${var.hot_model}"]
            device: "cuda:0"
            dtype: bfloat16
            kv_cache_mb: ${var.kv_cache_mb}
            max_num_seqs: 64
            max_num_batched_tokens: 8192
            heartbeat_period_s: 0.5
        EOT
      }

      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
        {{ with nomadVar "nomad/jobs" }}TALARIA__NATS__USER={{ .nats_user }}
        TALARIA__NATS__PASSWORD={{ .nats_password }}
        TALARIA__KVSTORE__AUTH_TOKEN={{ .kvstore_token }}{{ end }}
        EOT
      }

      resources {
        cpu    = 8000
        memory = 65536

        device "nvidia/gpu" {
          count = var.gpus_per_engine

          constraint {
            attribute = "${device.attr.memory}"
            operator  = ">="
            value     = var.min_gpu_memory
          }

          affinity {
            attribute = "${device.model}"
            operator  = "regexp"
            value     = "H100|H200|A100"
            weight    = 50
          }
        }
      }
    }
  }

  group "cold" {
    count = var.cold_count

    constraint {
      attribute = "${meta.talaria_gpu_node}"
      value     = "true"
    }

    volume "models" {
      type      = "host"
      source    = var.models_host_volume
      read_only = true
    }

    restart {
      attempts = 3
      interval = "10m"
      delay    = "20s"
      mode     = "delay"
    }

    reschedule {
      delay          = "30s"
      delay_function = "exponential"
      max_delay      = "10m"
      unlimited      = true
    }

    service {
      name     = "talaria-engine"
      provider = "consul"
      tags     = ["cold", "engine-${NOMAD_GROUP_NAME}-${NOMAD_ALLOC_INDEX}"]
      check {
        name     = "heartbeat"
        type     = "script"
        task     = "engine"
        command  = "talaria"
        args     = ["health", "--config", "/local/cluster.yaml", "--engine", "${NOMAD_GROUP_NAME}-${NOMAD_ALLOC_INDEX}"]
        interval = "10s"
        timeout  = "8s"
        check_restart {
          limit = 3
          grace = "300s"
        }
      }
    }

    task "engine" {
      driver       = "docker"
      kill_signal  = "SIGTERM"
      kill_timeout = "40s"

      config {
        image        = var.image
        network_mode = "host"
        args         = ["engine", "--config", "/local/cluster.yaml", "--id", "${NOMAD_GROUP_NAME}-${NOMAD_ALLOC_INDEX}"]
        cap_add      = ["ipc_lock"]
        ulimit {
          memlock = "-1"
        }
        devices = [
          {
            host_path      = "/dev/infiniband"
            container_path = "/dev/infiniband"
          }
        ]
      }

      volume_mount {
        volume      = "models"
        destination = "/models"
        read_only   = true
      }

      env {
        NATS_URL                    = var.nats_url
        TALARIA__KVSTORE__HOST      = "${attr.unique.network.ip-address}"
        TALARIA__KVSTORE__PORT      = var.kvstore_grpc_port
        TALARIA__KVSTORE__PROTOCOL  = "rdma"
        TALARIA__KVSTORE__DATA_HOST = "${attr.unique.network.ip-address}"
        OTEL_SERVICE_NAME           = "talaria-engine"
      }

      template {
        destination = "local/cluster.yaml"
        data        = <<-EOT
        namespace: ${var.namespace}
        models_dir: /models
        synthesize_models: false
        engines:
          - id: {{ env "NOMAD_GROUP_NAME" }}-{{ env "NOMAD_ALLOC_INDEX" }}
            pool: cold
            models: ${jsonencode(var.cold_models)}
            device: "cuda:0"
            dtype: bfloat16
            kv_cache_mb: ${var.kv_cache_mb}
            max_num_seqs: 64
            max_num_batched_tokens: 8192
            heartbeat_period_s: 0.5
        EOT
      }

      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
        {{ with nomadVar "nomad/jobs" }}TALARIA__NATS__USER={{ .nats_user }}
        TALARIA__NATS__PASSWORD={{ .nats_password }}
        TALARIA__KVSTORE__AUTH_TOKEN={{ .kvstore_token }}{{ end }}
        EOT
      }

      resources {
        cpu    = 8000
        memory = 131072

        device "nvidia/gpu" {
          count = var.gpus_per_engine

          constraint {
            attribute = "${device.attr.memory}"
            operator  = ">="
            value     = var.min_gpu_memory
          }
        }
      }
    }
  }
}
