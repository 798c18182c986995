# One kvstore per node (system job): the node's host KV registry, bytes over Mooncake (RDMA in the
# cluster). Host networking so Mooncake peers reach it at the node's address.
variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}
variable "image" {
  type    = string
  default = "talaria:cuda"
}
variable "nats_url" {
  type        = string
  description = "comma-separated NATS members, e.g. nats://10.0.0.11:4222,nats://10.0.0.12:4222,nats://10.0.0.13:4222"
}
variable "grpc_port" {
  type    = number
  default = 50061
}
variable "capacity_mb" {
  type    = number
  default = 262144
}
variable "mooncake_protocol" {
  type    = string
  default = "rdma"
}
variable "memory_mb" {
  type    = number
  default = 270336
}

job "talaria-kvstore" {
  datacenters = var.datacenters
  type        = "system"

  constraint {
    attribute = "${meta.talaria_gpu_node}"
    value     = "true"
  }

  update {
    max_parallel     = 1
    min_healthy_time = "15s"
    healthy_deadline = "3m"
    stagger          = "30s"
  }

  group "kvstore" {
    network {
      mode = "host"
      port "grpc" { static = var.grpc_port }
    }

    restart {
      attempts = 3
      interval = "5m"
      delay    = "15s"
      mode     = "delay"
    }

    service {
      name     = "talaria-kvstore"
      port     = "grpc"
      provider = "consul"
      tags     = ["node-${node.unique.name}"]
      check {
        name         = "grpc-health"
        type         = "grpc"
        port         = "grpc"
        grpc_service = ""
        interval     = "10s"
        timeout      = "3s"
      }
    }

    task "kvstore" {
      driver = "docker"

      config {
        image        = var.image
        network_mode = "host"
        args         = ["kvstore", "--config", "/local/cluster.yaml", "--host", "0.0.0.0", "--port", "${NOMAD_PORT_grpc}", "--capacity-mb", "${var.capacity_mb}"]
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
        shm_size = 17179869184
      }

      env {
        NATS_URL                    = var.nats_url
        TALARIA__KVSTORE__PROTOCOL  = var.mooncake_protocol
        TALARIA__KVSTORE__DATA_HOST = "${attr.unique.network.ip-address}"
        OTEL_SERVICE_NAME           = "talaria-kvstore"
      }

      template {
        destination = "local/cluster.yaml"
        data        = file("../config/cluster.gpu.yaml")
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
        cpu    = 4000
        memory = var.memory_mb
      }
    }
  }
}
