# NATS cluster of three with JetStream; one member per node (distinct hosts), static ports on the host so
# that Talaria services and the other members reach it at <node address>:4222 / :6222.
variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}
variable "nats_image" {
  type    = string
  default = "nats:2.11-alpine"
}
variable "js_max_mem" {
  type    = string
  default = "4G"
}
variable "js_max_file" {
  type    = string
  default = "50G"
}

job "talaria-nats" {
  datacenters = var.datacenters
  type        = "service"

  constraint {
    attribute = "${meta.talaria_nats}"
    value     = "true"
  }

  update {
    max_parallel      = 1
    min_healthy_time  = "10s"
    healthy_deadline  = "3m"
    progress_deadline = "10m"
    auto_revert       = true
  }

  group "nats" {
    count = 3

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    network {
      port "client" { static = 4222 }
      port "cluster" { static = 6222 }
      port "monitor" { static = 8222 }
    }

    volume "jetstream" {
      type      = "host"
      source    = "nats-jetstream"
      read_only = false
    }

    restart {
      attempts = 5
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    service {
      name     = "talaria-nats"
      port     = "client"
      provider = "consul"
      check {
        name     = "jetstream-health"
        type     = "http"
        port     = "monitor"
        path     = "/healthz?js-enabled-only=true"
        interval = "5s"
        timeout  = "2s"
      }
    }

    service {
      name     = "talaria-nats-cluster"
      port     = "cluster"
      provider = "consul"
    }

    task "nats" {
      driver = "docker"

      config {
        image        = var.nats_image
        network_mode = "host"
        args         = ["nats-server", "-c", "/local/nats.conf", "--routes", "${NATS_CLUSTER_ROUTES}"]
      }

      volume_mount {
        volume      = "jetstream"
        destination = "/data"
      }

      env {
        NATS_SERVER_NAME = "nats-${node.unique.name}"
        NATS_JS_MAX_MEM  = var.js_max_mem
        NATS_JS_MAX_FILE = var.js_max_file
      }

      # The members find each other through Consul service discovery (re-rendered when one moves).
      template {
        destination = "local/routes.env"
        env         = true
        change_mode = "noop"
        data        = <<-EOT
        NATS_CLUSTER_ROUTES={{ range $i, $s := service "talaria-nats-cluster" }}{{ if $i }},{{ end }}nats://{{ $s.Address }}:{{ $s.Port }}{{ end }}
        EOT
      }

      # Passwords from Nomad variables (nomad var put nomad/jobs/talaria-nats nats_password=... observer_password=...).
      template {
        destination = "secrets/auth.env"
        env         = true
        data        = <<-EOT
        {{ with nomadVar "nomad/jobs/talaria-nats" }}NATS_TALARIA_PASSWORD={{ .nats_password }}
        NATS_OBSERVER_PASSWORD={{ .observer_password }}{{ end }}
        EOT
      }

      template {
        destination = "local/nats.conf"
        data        = file("../nats/nats.conf")
      }

      template {
        destination = "local/auth.conf"
        data        = file("../nats/auth.example.conf")
      }

      resources {
        cpu    = 2000
        memory = 4096
      }
    }
  }
}
