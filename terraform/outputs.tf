output "endpoint" {
  description = "OpenAI-compatible base URL of the node (give it to your agent with the API key)."
  value       = "http://${var.associate_public_ip ? aws_instance.node.public_ip : aws_instance.node.private_ip}:${var.proxy_port}/v1"
}

output "instance_id" {
  description = "The node (open a shell with `aws ssm start-session --target <id>`)."
  value       = aws_instance.node.id
}

output "bucket" {
  description = "Bucket holding checkpoints and store backups."
  value       = aws_s3_bucket.this.id
}

output "api_key_secret_arn" {
  description = "Secrets Manager secret holding the bearer key."
  value       = aws_secretsmanager_secret.api_key.arn
}

output "api_key_command" {
  description = "Prints the API key."
  value       = "aws secretsmanager get-secret-value --region ${var.region} --secret-id ${aws_secretsmanager_secret.api_key.arn} --query SecretString --output text"
}
