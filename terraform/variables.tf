variable "name" {
  description = "Prefix of every resource name (bucket, secret, role, instance)."
  type        = string
  default     = "clawbridge"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,30}$", var.name))
    error_message = "name: 2-31 lowercase letters, digits or dashes (it becomes part of a bucket name)."
  }
}

variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-east-1"
}

variable "instance_type" {
  description = "GPU instance type (g5.xlarge: 1x A10G 24 GB; g6e.xlarge: 1x L40S 48 GB; p5.48xlarge: 8x H100)."
  type        = string
  default     = "g5.xlarge"
}

variable "gpu_count" {
  description = "GPUs clawbridge uses on the node (NUM_GPUS). Must not exceed what instance_type has."
  type        = number
  default     = 1

  validation {
    condition     = var.gpu_count >= 1 && var.gpu_count <= 8
    error_message = "gpu_count: 1 to 8."
  }
}

variable "model" {
  description = "Model clawbridge serves and trains: a Hugging Face id (owner/name, downloaded once at first boot into the data directory), a clawbridge registry name (smollm2-135m-instruct), or an absolute path to a Hugging Face folder on the node."
  type        = string
  default     = "Qwen/Qwen3-4B-Instruct-2507"

  validation {
    condition     = can(regex("^([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*|smollm2-135m-instruct|/.+)$", var.model))
    error_message = "model: a Hugging Face id such as Qwen/Qwen3-4B-Instruct-2507 (downloaded at first boot), the registry name smollm2-135m-instruct, or an absolute path to a model folder on the node."
  }
}

variable "proxy_port" {
  description = "Port of the OpenAI-compatible endpoint."
  type        = number
  default     = 30000
}

variable "allowed_cidrs" {
  description = "CIDR blocks allowed to reach the proxy port. Nothing else is open (no SSH: use SSM Session Manager)."
  type        = list(string)

  validation {
    condition     = length(var.allowed_cidrs) > 0 && alltrue([for c in var.allowed_cidrs : can(cidrhost(c, 0))])
    error_message = "allowed_cidrs: at least one valid CIDR block, e.g. [\"203.0.113.7/32\"]."
  }
}

variable "vpc_id" {
  description = "VPC to run in (default: the region's default VPC)."
  type        = string
  default     = null
}

variable "subnet_id" {
  description = "Subnet of the node (default: the first subnet of the VPC)."
  type        = string
  default     = null
}

variable "associate_public_ip" {
  description = "Give the node a public IP (false: reachable only inside the VPC, e.g. over a VPN or peering)."
  type        = bool
  default     = true
}

variable "ami_id" {
  description = "AMI with NVIDIA drivers (default: the newest AWS Deep Learning OSS Nvidia Driver AMI, Ubuntu 22.04)."
  type        = string
  default     = null
}

variable "root_volume_gb" {
  description = "Size of the encrypted root volume (model weights, adapters, the store)."
  type        = number
  default     = 200
}

variable "clawbridge_package" {
  description = "pip requirement the node installs (a version, a wheel URL or a git URL)."
  type        = string
  default     = "clawbridge[gpu]"
}

variable "extra_env" {
  description = "Extra CLAWBRIDGE_* settings for the service (see docs/configuration.md), e.g. { CLAWBRIDGE_METHOD = \"binary\" }."
  type        = map(string)
  default     = {}
}

variable "backup_schedule" {
  description = "systemd OnCalendar expression for store and checkpoint backups to the bucket."
  type        = string
  default     = "hourly"
}

variable "noncurrent_version_days" {
  description = "Days a replaced backup object version is kept before it expires."
  type        = number
  default     = 30
}

variable "tags" {
  description = "Extra tags for every resource."
  type        = map(string)
  default     = {}
}
