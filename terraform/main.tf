# One GPU node running `clawbridge up --backend local` as a systemd service, with an encrypted,
# versioned bucket for checkpoints and store backups, the API key in Secrets Manager, and a
# security group that opens only the proxy port to the allowed CIDRs. Access is through SSM.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

data "aws_vpc" "selected" {
  id      = var.vpc_id
  default = var.vpc_id == null ? true : null
}

data "aws_subnets" "selected" {
  filter {
    name   = "vpc-id"
    values = [data.aws_vpc.selected.id]
  }
}

data "aws_ami" "gpu" {
  count       = var.ami_id == null ? 1 : 0
  most_recent = true
  owners      = ["amazon"]

  filter {
    name   = "name"
    values = ["Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *"]
  }

  filter {
    name   = "architecture"
    values = ["x86_64"]
  }
}

locals {
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  subnet_id  = coalesce(var.subnet_id, sort(data.aws_subnets.selected.ids)[0])
  ami_id     = var.ami_id != null ? var.ami_id : data.aws_ami.gpu[0].id
  data_dir   = "/var/lib/clawbridge"
  # clawbridge loads local folders and its registry names only (it never downloads at start): a
  # Hugging Face id is downloaded once at first boot into the data directory and served from there.
  model_is_hub = length(regexall("^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", var.model)) > 0
  model_path   = local.model_is_hub ? "${local.data_dir}/models/${replace(var.model, "/", "--")}" : var.model
}

# --- encryption key: the bucket, the secret and the root volume ---------------------------------

resource "aws_kms_key" "this" {
  description             = "${var.name}: checkpoints, store backups, API key, root volume"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdministers"
        Effect    = "Allow"
        Principal = { AWS = "arn:${local.partition}:iam::${local.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
    ]
  })
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this.key_id
}

# --- bucket: checkpoints and store backups ------------------------------------------------------

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_18:Access logging needs a second bucket; CloudTrail data events are the account-level choice.
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles storage cost; versioning already keeps every backup.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events; the node is the only writer.
  bucket_prefix = "${var.name}-"
  force_destroy = false
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "expire-replaced-backups"
    status = "Enabled"
    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

resource "aws_s3_bucket_policy" "tls_only" {
  bucket = aws_s3_bucket.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "DenyPlainHttp"
      Effect    = "Deny"
      Principal = "*"
      Action    = "s3:*"
      Resource  = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]
      Condition = { Bool = { "aws:SecureTransport" = "false" } }
    }]
  })
  depends_on = [aws_s3_bucket_public_access_block.this]
}

# --- the API key --------------------------------------------------------------------------------

data "aws_secretsmanager_random_password" "api_key" {
  password_length     = 48
  exclude_punctuation = true
}

resource "aws_secretsmanager_secret" "api_key" {
  #checkov:skip=CKV2_AWS_57:The key is a bearer token shared with the agents; rotate it with `terraform apply -replace` (docs/terraform.md).
  name_prefix             = "${var.name}-api-key-"
  description             = "Bearer key of the clawbridge endpoint (CLAWBRIDGE_API_KEY)."
  kms_key_id              = aws_kms_key.this.arn
  recovery_window_in_days = 7
}

resource "aws_secretsmanager_secret_version" "api_key" {
  secret_id     = aws_secretsmanager_secret.api_key.id
  secret_string = data.aws_secretsmanager_random_password.api_key.random_password

  # The data source draws a new password on every plan; keep the first one.
  lifecycle {
    ignore_changes = [secret_string]
  }
}

# --- the node's identity: SSM, the secret, the bucket -------------------------------------------

resource "aws_iam_role" "node" {
  name_prefix = "${var.name}-node-"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
}

resource "aws_iam_role_policy_attachment" "ssm" {
  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_role_policy" "node" {
  name = "clawbridge-node"
  role = aws_iam_role.node.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid      = "ReadApiKey"
        Effect   = "Allow"
        Action   = ["secretsmanager:GetSecretValue"]
        Resource = [aws_secretsmanager_secret.api_key.arn]
      },
      {
        Sid      = "ListBackups"
        Effect   = "Allow"
        Action   = ["s3:ListBucket"]
        Resource = [aws_s3_bucket.this.arn]
      },
      {
        Sid      = "ReadWriteBackups"
        Effect   = "Allow"
        Action   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"]
        Resource = ["${aws_s3_bucket.this.arn}/*"]
      },
      {
        Sid      = "UseKey"
        Effect   = "Allow"
        Action   = ["kms:Decrypt", "kms:GenerateDataKey"]
        Resource = [aws_kms_key.this.arn]
      },
    ]
  })
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = "${var.name}-node-"
  role        = aws_iam_role.node.name
}

# --- network: the proxy port from the allowed CIDRs, nothing else in ------------------------------

resource "aws_security_group" "node" {
  name_prefix = "${var.name}-node-"
  description = "clawbridge proxy port from the allowed CIDRs; HTTPS out for packages, SSM and S3"
  vpc_id      = data.aws_vpc.selected.id

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "proxy" {
  for_each          = toset(var.allowed_cidrs)
  security_group_id = aws_security_group.node.id
  description       = "clawbridge OpenAI-compatible endpoint"
  cidr_ipv4         = each.value
  ip_protocol       = "tcp"
  from_port         = var.proxy_port
  to_port           = var.proxy_port
}

resource "aws_vpc_security_group_egress_rule" "https" {
  security_group_id = aws_security_group.node.id
  description       = "HTTPS: package index, model hub, SSM, S3, Secrets Manager"
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
}

resource "aws_vpc_security_group_egress_rule" "http" {
  security_group_id = aws_security_group.node.id
  description       = "HTTP: Ubuntu package mirrors"
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 80
  to_port           = 80
}

# --- the node -----------------------------------------------------------------------------------

resource "aws_instance" "node" {
  #checkov:skip=CKV_AWS_88:The public IP is the endpoint; the security group admits only allowed_cidrs to the proxy port (set associate_public_ip = false for VPC-only).
  ami                         = local.ami_id
  instance_type               = var.instance_type
  subnet_id                   = local.subnet_id
  vpc_security_group_ids      = [aws_security_group.node.id]
  iam_instance_profile        = aws_iam_instance_profile.node.name
  associate_public_ip_address = var.associate_public_ip
  monitoring                  = true
  ebs_optimized               = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  root_block_device {
    volume_type           = "gp3"
    volume_size           = var.root_volume_gb
    encrypted             = true
    kms_key_id            = aws_kms_key.this.arn
    delete_on_termination = true
  }

  user_data_replace_on_change = true
  user_data = templatefile("${path.module}/user_data.sh.tftpl", {
    package    = var.clawbridge_package
    model      = var.model
    model_hub  = local.model_is_hub ? var.model : ""
    model_path = local.model_path
    port       = var.proxy_port
    gpu_count  = var.gpu_count
    region     = var.region
    secret_arn = aws_secretsmanager_secret.api_key.arn
    bucket     = aws_s3_bucket.this.id
    data_dir   = local.data_dir
    schedule   = var.backup_schedule
    extra_env  = var.extra_env
  })

  tags = { Name = var.name }

  depends_on = [aws_secretsmanager_secret_version.api_key, aws_iam_role_policy.node]
}
